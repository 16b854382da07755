"""Helpers that the command line and the benchmarks share: device synchronisation, the default thread count, chat
encoding and the drafter to run (a folder, else the shipped SmolLM2 drafter, else an untrained one).

torch and the core are imported inside the functions, so importing this module (as `dflash --help` does) is instant.
"""

from __future__ import annotations

import os
from pathlib import Path

from .smollm2 import SHIPPED_DRAFTER


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA only), so that wall-clock timings cover the work they time."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def default_threads() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def encode_chat(tokenizer, prompt: str, device=None):
    """`prompt` as one user turn of the tokenizer's chat template (plain text when it has none): [1, seq] ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        # The template already holds every special token it needs.
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    return input_ids.to(device) if device is not None else input_ids


def load_drafter(
    target,
    path: str | os.PathLike | None = None,
    block_size: int | None = None,
    num_layers: int = 1,
    attn: str | None = None,
):
    """`(drafter, description, trained)` for `target`, in its dtype and on its device: the drafter at `path`, else the
    shipped SmolLM2 drafter when its folder is there, else an untrained one (`num_layers`, block 16 unless
    `block_size`; seeded, so that two runs measure the same drafter). `block_size` overrides a trained drafter's
    block; `attn` sets the drafter's attention implementation."""
    import torch

    from .modeling_dflash import DFlashDraftModel

    param = next(target.parameters())
    folder = Path(path) if path is not None else SHIPPED_DRAFTER
    if path is not None or (folder / "config.json").is_file():
        drafter = DFlashDraftModel.from_pretrained(folder, dtype=param.dtype).to(param.device).eval()
        if block_size is not None:
            drafter.config.block_size = block_size
        description, trained = f"trained, from {folder}", True
    else:
        torch.manual_seed(0)
        drafter = DFlashDraftModel.from_target(target, num_layers=num_layers, block_size=block_size or 16).eval()
        description = f"UNTRAINED (random weights, {num_layers} layer(s)): no speedup expected"
        trained = False
    if attn:
        drafter.config._attn_implementation = attn
    description += f", block {drafter.config.block_size}"
    return drafter, description, trained
