"""Writing a drafter in any of the three layouts, with its model card, checked against the layout's schema."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from ..code_files import RELEASED_AUTO_MAP, write_code_files
from ..model_card import CardMetadata, write_model_card
from ..modeling_dflash import DFlashDraftModel
from .check import check_layout
from .layouts import CARD_NAME, CODE_FILES, CONFIG_NAME, LAYOUTS, PICKLE_SUFFIXES, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .released import released_config
from .speculators import speculators_config
from .target import check_fits_target, target_info
from .weights import save_safetensors, state_dict_for_safetensors


def _drafter_dtype(drafter: torch.nn.Module) -> torch.dtype:
    return next(drafter.parameters()).dtype


def _managed_file(name: str) -> bool:
    return (
        name in (CONFIG_NAME, CARD_NAME, WEIGHTS_INDEX_NAME, "generation_config.json")
        or name in CODE_FILES
        or name.endswith(".safetensors")
        or name.endswith(PICKLE_SUFFIXES)
    )


def _prepare_out_dir(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a folder.")
    out.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in out.iterdir())
    if present and not overwrite:
        raise FileExistsError(f"{out} is not empty ({', '.join(present[:5])}...); pass overwrite=True (--overwrite).")
    for name in present:  # overwrite: drop the checkpoint files of a previous export, keep anything else
        if (out / name).is_file() and _managed_file(name):
            (out / name).unlink()
    return out


def export_drafter(
    drafter: DFlashDraftModel,
    out_dir: str | os.PathLike,
    layout: str,
    target_name_or_path=None,
    card_metadata: CardMetadata | dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` into `out_dir` in `layout` ("hub", "released" or "speculators"); returns the folder.

    target_name_or_path: the target's Hub id or path (or the model / its config): the card's `base_model`, the
        speculators `verifier`, and, when its config is on disk, a check that the drafter fits it.
    card_metadata: training metadata for the model card (`transformers_dflash.model_card.CardMetadata` or a dict).
    overwrite: allow a non-empty `out_dir` (its previous checkpoint files are removed, other files kept).

    The folder is checked against the layout's schema before returning (`check_layout`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    config = drafter.config
    if layout != "hub" and getattr(config, "draft_vocab_size", None) is not None:
        raise ValueError(
            f"This drafter drafts from a reduced vocabulary ({config.draft_vocab_size} tokens, `draft_vocab_ids`), "
            f"which the {layout} layout cannot express (its readers score the target's whole LM head). Export it "
            "with --layout hub, or train a drafter without --draft-vocab-size for that layout."
        )
    target = target_info(target_name_or_path)
    check_fits_target(config, target)
    metadata = CardMetadata.coerce(card_metadata)
    if target.name and not metadata.target:
        metadata = metadata.merged({"target": target.name})
    out = _prepare_out_dir(out_dir, overwrite)
    dtype = _drafter_dtype(drafter)

    if layout == "hub":
        drafter.save_pretrained(out)
        write_code_files(out)  # also for a drafter class whose save_pretrained does not write them
    elif layout == "released":
        content = released_config(config, dtype, num_target_layers=target.num_layers)
        (out / CONFIG_NAME).write_text(json.dumps(content, indent=2) + "\n")
        save_safetensors(state_dict_for_safetensors(drafter), out / WEIGHTS_NAME)
        write_code_files(out, RELEASED_AUTO_MAP)
    else:
        if target.name is None:
            warnings.warn(
                "No target given: the speculators config names no verifier (speculators_config.verifier.name_or_path "
                "is null), so `vllm serve DIR` cannot find the target; name it on the vLLM command line instead.",
                stacklevel=2,
            )
        content = speculators_config(config, dtype, target)
        (out / CONFIG_NAME).write_text(json.dumps(content, indent=2) + "\n")
        save_safetensors(state_dict_for_safetensors(drafter), out / WEIGHTS_NAME)

    files = sorted(p.name for p in out.iterdir() if p.is_file()) + [CARD_NAME]
    write_model_card(out, config, metadata, layout, files=_card_file_order(files))
    problems = check_layout(out, layout)
    if problems:
        raise RuntimeError(f"The exported {layout} folder {out} does not match its schema: {problems}")
    return out


def _card_file_order(files: list[str]) -> list[str]:
    order = [CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, *CODE_FILES, CARD_NAME]
    known = [name for name in order if name in files]
    return known + sorted(set(files) - set(known))
