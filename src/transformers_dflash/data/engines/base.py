"""What the generation engines share (`transformers_dflash.data.engines`): their errors, the cut of a response at its
first EOS, length buckets for batches, and the digest of a model's weights that names a conversion or a run."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_PAD_FRACTION = 0.1

OnBatch = Callable[[int, int], None]


class EngineError(RuntimeError):
    """A generation engine failed or is misconfigured; the message says what to do."""


class ServerError(EngineError):
    """An OpenAI-compatible server could not answer (after retries)."""


class TokenizerMismatchError(EngineError):
    """The server tokenizes differently from the target's tokenizer (another model, tokenizer or chat template)."""


def response_ids(generated: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int | None = None) -> list[int]:
    """Generated tokens up to and including the first EOS (what follows is padding), at most `max_new_tokens`."""
    generated = list(generated)[:max_new_tokens] if max_new_tokens is not None else list(generated)
    eos = set(eos_ids)
    for i, token in enumerate(generated):
        if token in eos:
            return generated[: i + 1]
    return generated


def length_buckets(
    lengths: Sequence[int], batch_size: int, max_new_tokens: int, pad_fraction: float = DEFAULT_PAD_FRACTION
) -> list[list[int]]:
    """Indices of `lengths` in batches of similar length, longest first.

    Prompts are sorted by length (longest first, ties by index) and cut into batches of at most `batch_size`; a new
    batch also starts when the next prompt would be padded by more than `pad_fraction` of the batch's sequence slot
    (its longest prompt + `max_new_tokens`). So a short prompt is never padded to a long one.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]
            if len(batch) < batch_size and longest - lengths[i] <= pad_fraction * (longest + max_new_tokens):
                batch.append(i)
                continue
        batches.append([i])
    return batches


def generate_in_buckets(
    prompts: list[list[int]],
    generate_batch: Callable[[list[list[int]]], list[list[int]]],
    batch_size: int,
    max_new_tokens: int,
    pad_fraction: float,
    on_batch: OnBatch | None = None,
) -> list[list[int]]:
    """`generate_batch` over the `length_buckets` of `prompts`; the responses in the prompts' order."""
    results: list[list[int] | None] = [None] * len(prompts)
    for batch in length_buckets([len(p) for p in prompts], batch_size, max_new_tokens, pad_fraction):
        outputs = generate_batch([prompts[i] for i in batch])
        for i, out in zip(batch, outputs):
            results[i] = out
        if on_batch is not None:
            on_batch(len(batch), sum(len(o) for o in outputs))
    return results  # type: ignore[return-value]


_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "_commit_hash",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
    "attn_implementation",
    "use_cache",
}


def weights_sha256(model: Any) -> str:
    """SHA-256 of a torch model's state dict (names, dtypes, shapes and bytes) and its config."""
    import torch

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:  # without what saving or loading changes (names, versions; dtypes show in the tensors)
        settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        h.update(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_dtype(model: Any) -> str:
    dtype = getattr(model, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"
