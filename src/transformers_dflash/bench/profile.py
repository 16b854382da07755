"""Where a speculative step's time goes: exclusive wall time of drafting, verifying, cache cropping, accepting and
the rest of one DFlash `generate()` call (ours or transformers' built-in path)."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

from ..runtime import synchronize
from .assisted import AssistedRecorder
from .drafter import core_module, draft_length, ngram_lookup
from .metrics import mean_acceptance_length


class StepProfiler:
    """Exclusive wall time of the parts of a DFlash `generate()` call, by wrapping the functions that do them:

    - `draft`: the drafter's proposal (ours: `DFlashCandidateGenerator.draft`; built-in:
      `DFlashTokenCandidateGenerator.get_candidates`), drafter forward + LM head on the block + bookkeeping;
    - `target_forward`: the target's `forward` (the first call is the prefill, the others verify blocks);
    - `cache_crop`: `DynamicCache.crop` (target cache; the built-in drafter's cache is one too);
    - `accept_commit`: ours only: logits processing, choices and stopping checks (`process_logits`, `choose_tokens`,
      `stop_lengths`, as the decoding loop calls them);
    - everything else in the call is `other` (Python in the decoding loop and in `generate()`).

    Times are exclusive (a wrapped call inside another counts once, for the inner one). On CUDA every boundary
    synchronises the device, which costs a little and removes CPU/GPU overlap: profile in a separate run.
    """

    BUCKETS = ("draft", "target_forward", "cache_crop", "accept_commit")

    def __init__(self, target, kind: str = "dflash", drafter=None):
        self.target, self.kind, self.drafter = target, kind, drafter
        self.device = next(target.parameters()).device
        self.times = {b: 0.0 for b in self.BUCKETS}
        self.calls = {b: 0 for b in self.BUCKETS}
        self.forward_times: list[float] = []
        self.total = 0.0
        self._stack: list[list[float]] = []
        self._patches: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner, name: str, bucket: str) -> None:
        original = getattr(owner, name)
        profiler = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            synchronize(profiler.device)
            frame = [time.perf_counter(), 0.0]  # start, time spent in nested wrapped calls
            profiler._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                synchronize(profiler.device)
                elapsed = time.perf_counter() - frame[0]
                profiler._stack.pop()
                if profiler._stack:
                    profiler._stack[-1][1] += elapsed
                own = elapsed - frame[1]
                profiler.times[bucket] += own
                profiler.calls[bucket] += 1
                if bucket == "target_forward":
                    profiler.forward_times.append(own)

        setattr(owner, name, wrapper)
        self._patches.append((owner, name, original))

    def __enter__(self):
        from transformers.cache_utils import DynamicCache

        self._wrap(type(self.target), "forward", "target_forward")
        self._wrap(DynamicCache, "crop", "cache_crop")
        if self.kind == "dflash":
            self._wrap(core_module(self.drafter, "candidate_generator").DFlashCandidateGenerator, "draft", "draft")
            decoding = core_module(self.drafter, "decoding")
            for name in ("process_logits", "choose_tokens", "stop_lengths"):
                self._wrap(decoding, name, "accept_commit")
        else:
            from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

            self._wrap(DFlashTokenCandidateGenerator, "get_candidates", "draft")
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.total = time.perf_counter() - self._start
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()

    def breakdown(self) -> dict:
        """Milliseconds per verification step of each part; `prefill_ms` and `steps` besides."""
        prefill = self.forward_times[0] if self.forward_times else 0.0
        steps = max(1, len(self.forward_times) - 1)
        parts = {
            "draft": self.times["draft"],
            "verify": self.times["target_forward"] - prefill,
            "cache_crop": self.times["cache_crop"],
            "accept_commit": self.times["accept_commit"],
        }
        parts["other"] = self.total - prefill - sum(parts.values())
        out = {f"{k}_ms": 1000 * v / steps for k, v in parts.items()}
        out["step_ms"] = 1000 * (self.total - prefill) / steps
        out["prefill_ms"] = 1000 * prefill
        out["steps"] = steps
        return out


def profile_step(
    target,
    drafter,
    input_ids,
    kind: str = "dflash",
    builtin_drafter=None,
    max_new_tokens: int = 64,
    adaptive_draft_length="auto",
    **generate_kwargs,
) -> dict:
    """One greedy generation through our DFlash path (`kind="dflash"`, or `"dflash_adaptive"`) or transformers'
    (`"builtin_dflash"`), with a `StepProfiler`: milliseconds per step spent drafting, verifying, cropping caches,
    accepting, and elsewhere; plus the mean verified width (anchor included) and tau of that run."""
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
    kwargs.update(generate_kwargs)
    setting = adaptive_draft_length if kind == "dflash_adaptive" else "full"
    if kind == "builtin_dflash":
        extra = {"assistant_model": builtin_drafter, "speculation_type": "dflash"}
    else:
        extra = {"assistant_model": drafter}
    widths: list[int] = []

    def record_width(module, args, kwargs_):
        ids = kwargs_.get("input_ids", args[0] if args else None)
        if ids is not None:
            widths.append(int(ids.shape[1]))

    handle = target.register_forward_pre_hook(record_width, with_kwargs=True)
    recorder = AssistedRecorder()
    try:
        with (
            torch.inference_mode(),
            draft_length(drafter, setting),
            ngram_lookup(drafter, 0),
            recorder.watch(),
            StepProfiler(target, "builtin_dflash" if kind == "builtin_dflash" else "dflash", drafter) as profiler,
        ):
            target.generate(input_ids, **kwargs, **extra)
    finally:
        handle.remove()
    out = profiler.breakdown()
    acceptance = recorder.acceptance if kind == "builtin_dflash" else list(drafter.last_acceptance_lengths)
    out["mean_verified_width"] = sum(widths[1:]) / len(widths[1:]) if len(widths) > 1 else math.nan
    out["tau"] = mean_acceptance_length([acceptance])
    return out
