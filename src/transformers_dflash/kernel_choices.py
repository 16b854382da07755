"""Measured kernel choices kept between processes (part of the carried core: torch and the standard library only).

`skinny_linear` times its products once per (weight shape, row count, thread count) and keeps the fastest
(`kernels.kernel_for`). For SmolLM2-135M and its drafter that is about 50 measurements on copies of each weight out of
cache, which made a process's first generate() call about 1.5x as long as the next ones on a 2-core Intel Xeon
(docs/benchmarks.md, "Kernel choices kept between processes"): a script that generates once per run paid it every
run. So the choices are also written to a small JSON file, and a later process on the same machine starts from them.

Where: `$DFLASH_KERNEL_CACHE` (a folder; `off` keeps the choices in memory only), else `$DFLASH_CACHE/kernels`, else
`~/.cache/transformers_dflash/kernels`. One file per `describe_machine()`: what a choice depends on besides its key,
the CPU (model and instruction-set flags), torch's version and whether its oneDNN packing works here, and `FORMAT`,
raised whenever the measurement or its rule changes, so that older choices are not reused. A file that cannot be read or
written is passed over: the process measures, as it would without one. Delete the folder to measure afresh.
"""

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

FORMAT = 1
KERNELS = ("linear", "transposed", "packed")
_OFF = ("", "0", "off", "false", "no")


def choices_folder() -> Path | None:
    """The folder of the choice files, or None where `DFLASH_KERNEL_CACHE` turns them off."""
    setting = os.environ.get("DFLASH_KERNEL_CACHE")
    if setting is not None:
        return None if setting.strip().lower() in _OFF else Path(setting).expanduser()
    root = os.environ.get("DFLASH_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "transformers_dflash") / "kernels"


def describe_machine(packing: bool) -> dict:
    """What a measured choice depends on besides its key (`packing`: whether oneDNN's packed product works here)."""
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:  # Linux; elsewhere the platform's name
        for line in cpuinfo:
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = " ".join(sorted(value.split()))
                break
    return {
        "format": FORMAT,
        "cpu": model,
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "packing": packing,
    }


def choices_file(machine: dict) -> Path | None:
    """The file of this machine's choices (None: turned off)."""
    folder = choices_folder()
    if folder is None:
        return None
    return folder / f"{hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]}.json"


def load_choices(path: Path) -> dict[tuple[int, int, int, int], str]:
    """The choices in `path` ({} where it is missing or unreadable; entries that are not valid are left out)."""
    try:
        entries = json.loads(path.read_text()).get("choices", [])
    except (OSError, ValueError, AttributeError):
        return {}
    choices = {}
    for entry in entries if isinstance(entries, list) else []:
        if (
            isinstance(entry, list)
            and len(entry) == 5
            and entry[4] in KERNELS
            and all(type(k) is int for k in entry[:4])
        ):
            choices[tuple(entry[:4])] = entry[4]
    return choices


def save_choices(path: Path, machine: dict, choices: dict[tuple[int, int, int, int], str]) -> None:
    """Add `choices` to those in `path` (another process may have written some since it was read), atomically; a
    folder or disk that refuses the write is passed over."""
    merged = {**load_choices(path), **choices}
    document = {"machine": machine, "choices": [[*key, kernel] for key, kernel in sorted(merged.items())]}
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            temporary = file.name
            json.dump(document, file)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
