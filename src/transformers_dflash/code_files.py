"""The carried core: the files written next to every checkpoint, so that it loads with `trust_remote_code=True` where
this package is not installed (part of the carried core itself).

`dflash.py` is the entry point that a checkpoint's `auto_map` names, and it imports every other core file directly
(transformers 4.x copies only the files its entry point imports when it loads a local folder). The list of carried
files is therefore read from that one file, with transformers' own function, and written out nowhere else.
"""

import json
import shutil
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

ENTRY_POINT = "dflash.py"
# Our layout names our config class; the released layout (`model_type: "qwen3"`) names only the model.
HUB_AUTO_MAP = {"AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "dflash.DFlashDraftModel"}
RELEASED_AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}


def code_files() -> list[Path]:
    """The core's files: the entry point and everything it imports, recursively."""
    entry = Path(__file__).with_name(ENTRY_POINT)
    return [entry] + sorted(Path(f) for f in get_relative_import_files(entry))


def write_code_files(folder, auto_map: dict | None = None) -> list[str]:
    """Copy the core files into `folder` and point the `auto_map` of its config.json at them (`HUB_AUTO_MAP` unless
    given). Returns the names of the files written."""
    folder = Path(folder)
    names = []
    for path in code_files():
        shutil.copyfile(path, folder / path.name)
        names.append(path.name)
    config_path = folder / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = dict(HUB_AUTO_MAP if auto_map is None else auto_map)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return names
