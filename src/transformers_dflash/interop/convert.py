"""Reading a drafter in any layout back into a `DFlashDraftModel`, with the model-card metadata it records.

Reading is strict: the layout is detected from config.json; only safetensors are read (pickled `.bin`/`.pt` files are
refused with a clear message, never unpickled); no code from the folder is ever run (the installed classes are used);
missing, unexpected or mis-shaped tensors raise."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

from ..configuration_dflash import DFlashConfig
from ..model_card import metadata_from_training_dir
from ..modeling_dflash import DFlashDraftModel
from .layouts import CARD_NAME, CONFIG_NAME, LAYOUTS, WEIGHTS_INDEX_NAME, detect_layout, read_config
from .speculators import SPECULATORS_VERIFIER_TENSORS, speculators_to_dflash_config
from .weights import read_safetensors, weight_files

logger = logging.getLogger(__name__)


def dflash_config_from_folder(folder: Path, layout: str, content: dict | None = None) -> DFlashConfig:
    content = content if content is not None else read_config(folder)
    if layout == "speculators":
        return speculators_to_dflash_config(content)
    kwargs = {k: v for k, v in content.items() if k not in ("model_type", "transformers_version")}
    return DFlashConfig(**kwargs)


def _resolve_dtype(dtype, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    if dtype in (None, "auto"):
        floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
        return floating[0] if floating else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class _QuietConfigWarnings:
    """Silence transformers' 'model of type qwen3 to instantiate a model of type dflash' note: expected here."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.logger = hf_logging.get_logger("transformers.configuration_utils")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def local_folder(path: str | os.PathLike) -> Path:
    """A local folder for `path`; a Hub repo id is fetched WITHOUT its code or pickled files (config, safetensors and
    the card only)."""
    if os.path.isdir(path):
        return Path(path)
    if isinstance(path, str) and path.count("/") == 1 and not os.path.exists(path):
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(path, allow_patterns=[CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME, CARD_NAME])
            )
        except Exception as error:  # noqa: BLE001 - offline, unknown repo, no access: one clear message
            raise FileNotFoundError(
                f"{path} is not a local folder, and fetching it from the Hub failed: {type(error).__name__}: {error}"
            ) from error
    raise FileNotFoundError(f"{path} is not a folder (nor a Hub repo id).")


def convert_drafter(path: str | os.PathLike, dtype="auto", layout: str | None = None) -> DFlashDraftModel:
    """A `DFlashDraftModel` from a drafter checkpoint in any layout (detected from config.json unless `layout` is set).

    Only safetensors are read (pickled weights are refused with a ValueError), no code from the folder runs, and every
    tensor must match (ValueError otherwise). `dtype`: "auto" (the checkpoint's), a torch dtype or its name.
    """
    folder = local_folder(path)
    layout = layout or detect_layout(folder)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    _, notes = weight_files(folder)  # refuses pickled-only folders before anything is loaded
    for note in notes:
        warnings.warn(f"{folder}: {note}", stacklevel=2)
    if layout in ("hub", "released"):
        with _QuietConfigWarnings():
            return DFlashDraftModel.from_pretrained(folder, dtype=dtype).eval()

    config = speculators_to_dflash_config(read_config(folder))
    tensors = read_safetensors(folder)
    dropped = sorted(name for name in tensors if name in SPECULATORS_VERIFIER_TENSORS)
    if dropped:
        logger.info("Dropping the verifier-owned tensors %s: the drafter borrows the target's.", dropped)
    tensors = {name: t for name, t in tensors.items() if name not in SPECULATORS_VERIFIER_TENSORS}
    drafter = DFlashDraftModel._from_config(config, dtype=_resolve_dtype(dtype, tensors))
    expected = drafter.state_dict()
    problems = {
        "missing": sorted(set(expected) - set(tensors)),
        "unexpected": sorted(set(tensors) - set(expected)),
        "mis-shaped": sorted(n for n in set(expected) & set(tensors) if expected[n].shape != tensors[n].shape),
    }
    problems = {kind: names for kind, names in problems.items() if names}
    if problems:
        details = "; ".join(f"{kind} tensors: {names[:8]}" for kind, names in problems.items())
        raise ValueError(
            f"The speculators checkpoint in {folder} does not match the DFlash drafter layout ({details})."
        )
    drafter.load_state_dict(tensors, strict=True)
    return drafter.eval()


def card_info(path: str | os.PathLike) -> dict:
    """Model-card metadata recorded in a drafter folder: the speculators verifier (as `target`), the Hub YAML of its
    README.md (`base_model`, `datasets`, `license`, `language`, extra `tags`), and `dflash train`'s log.jsonl."""
    folder = Path(path)
    found: dict = {}
    try:
        content = read_config(folder)
    except FileNotFoundError:
        content = {}
    verifier = (content.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        found["target"] = verifier["name_or_path"]
    if (folder / CARD_NAME).is_file():
        try:
            from huggingface_hub import ModelCard

            data = ModelCard.load(folder / CARD_NAME).data.to_dict()
        except Exception:  # noqa: BLE001 - a card without valid YAML simply contributes nothing
            data = {}
        if isinstance(data.get("base_model"), str):
            found.setdefault("target", data["base_model"])
        for key in ("datasets", "license", "language"):
            if data.get(key):
                found[key] = data[key]
        extra = [t for t in data.get("tags") or [] if t not in ("dflash", "speculative-decoding")]
        if extra:
            found["tags"] = extra
    found.update(metadata_from_training_dir(folder))
    return found
