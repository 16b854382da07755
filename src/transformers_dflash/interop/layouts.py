"""The three checkpoint layouts, the file names they share, and telling them apart from config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..code_files import code_files

LAYOUTS = ("hub", "released", "speculators")
CODE_FILES = tuple(path.name for path in code_files())  # the carried core, as `code_files` defines it
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def read_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {folder}: not a drafter checkpoint folder.")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def detect_layout(folder: str | os.PathLike) -> str:
    """ "hub", "released" or "speculators", from the folder's config.json."""
    content = read_config(Path(folder))
    if "speculators_model_type" in content:
        return "speculators"
    if content.get("model_type") == "dflash":
        return "hub"
    if "dflash_config" in content or "DFlashDraftModel" in (content.get("architectures") or []):
        return "released"
    raise ValueError(
        f"{Path(folder) / CONFIG_NAME} does not describe a DFlash drafter: expected model_type 'dflash' (our layout), "
        "a dflash_config (released DFlash layout) or speculators_model_type 'dflash' (vLLM speculators layout)."
    )
