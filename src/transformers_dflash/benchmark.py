"""`dflash bench`: DFlash side by side with plain decoding, transformers' own DFlash path and prompt lookup.

    dflash bench --dataset mtbench --num-prompts 5 --max-new-tokens 64 --threads 1
    dflash bench --dataset mtbench --dataset humaneval --dataset my_prompts.jsonl --temperatures 0
    dflash bench --quick                     # tiny random models, seconds: a smoke test of the whole pipeline

In ONE process, on the same prompts and the same target, it times (methods interleaved per prompt, after warm-up runs,
so that machine noise hits all of them alike):

- `baseline`: plain `target.generate()`;
- `dflash`: this package, `target.generate(assistant_model=drafter)`, verifying the whole block every step;
- `dflash_adaptive`: the same with `drafter.draft_length` (default `"auto"`): only the drafts worth their
  verification cost are verified (lossless; see the README);
- `builtin_dflash`: transformers' own `speculation_type="dflash"` path (transformers >= 5 with
  `models/muse_glimmer_assistant`), fed the SAME drafter weights, converted by `to_builtin_drafter`;
- `prompt_lookup`: prompt lookup decoding (`prompt_lookup_num_tokens`), the drafter-free alternative;
- optional: `early_exit` (self-speculation with the target's first layers, `assistant_early_exit`) and `assistant`
  (classic speculative decoding with a small model of the same vocabulary, `--assistant-model`).

Reports per method (and dataset, temperature): tokens/s, time per output token, speedup over the baseline, the mean
acceptance length tau (tokens committed per target forward after the prefill; 1.0 for the baseline) with its
histogram, and r = tau / speedup (the implied per-step overhead: 1.0 is ideal). Greedy runs check that every method's
output equals the baseline's and flag any mismatch. Writes JSON (with the environment), Markdown and a PNG plot.

The library entry point is `run_benchmark(target, drafter, datasets=..., tokenizer=...)`; the report arithmetic lives
in small pure functions (`tokens_per_second`, `speedup`, `mean_acceptance_length`, `acceptance_histogram`,
`overhead_ratio`, `summarize`, `find_mismatches`) so it can be tested on hand-made numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_METHODS = ("baseline", "dflash", "dflash_adaptive", "builtin_dflash", "prompt_lookup")
# The *_skinny / dflash_stock_linears methods attribute speed to kernels: every method with the same CPU kernels
# (`kernels.cpu_kernels`: skinny linears and packed grouped-query attention).
OPTIONAL_METHODS = (
    "dflash_lookup", "early_exit", "assistant", "baseline_skinny", "prompt_lookup_skinny", "dflash_stock_linears"
)
METHOD_LABELS = {
    "baseline": "plain generate()",
    "dflash": "DFlash (transformers-dflash)",
    "dflash_adaptive": "DFlash, adaptive draft length (transformers-dflash)",
    "dflash_lookup": "DFlash + n-gram lookup, adaptive draft length (transformers-dflash)",
    "builtin_dflash": "DFlash (transformers built-in)",
    "prompt_lookup": "prompt lookup",
    "early_exit": "early-exit self-speculation",
    "assistant": "assistant model",
    "baseline_skinny": "plain generate(), DFlash's CPU kernels",
    "prompt_lookup_skinny": "prompt lookup, DFlash's CPU kernels",
    "dflash_stock_linears": "DFlash (transformers-dflash), stock kernels",
}
BATCH_METHODS = ("baseline", "dflash", "dflash_adaptive", "dflash_lookup", "baseline_skinny", "dflash_stock_linears")
PLAIN_METHODS = ("baseline", "baseline_skinny")  # no drafter: tau is 1 by definition
BUILTIN_DRAFTER_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
from .smollm2 import SHIPPED_DRAFTER  # noqa: E402

UNTRAINED_NOTE = (
    "The drafter is UNTRAINED (random weights): almost no draft is accepted, so tau is near 1 and both DFlash paths "
    "are SLOWER than plain generate(). These numbers measure the per-step overhead, not DFlash's speedup."
)


# ======================================================================================================================
# Report arithmetic: small pure functions on plain numbers
# ======================================================================================================================


def _nan_if_bad(value: float) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def tokens_per_second(tokens: float, seconds: float) -> float:
    """New tokens per wall-clock second (NaN when no time was measured)."""
    return tokens / seconds if seconds > 0 else math.nan


def time_per_output_token_ms(tokens: float, seconds: float) -> float:
    """Wall-clock milliseconds per new token, prefill included (NaN without tokens)."""
    return 1000.0 * seconds / tokens if tokens > 0 else math.nan


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    """How many times faster than the baseline (ratio of token rates)."""
    if not baseline_tokens_per_s or not math.isfinite(baseline_tokens_per_s) or not math.isfinite(tokens_per_s):
        return math.nan
    return tokens_per_s / baseline_tokens_per_s


def acceptance_steps(acceptance: Sequence[int]) -> list[int]:
    """Tokens committed per verification step: a run's acceptance list without its first entry (the prefill)."""
    return [int(n) for n in list(acceptance)[1:]]


def mean_acceptance_length(runs: Iterable[Sequence[int]]) -> float:
    """tau: mean tokens committed per target forward after the prefill, pooled over the steps of all runs.

    Each run is a list like `drafter.last_acceptance_lengths`: entry 0 is the prefill (excluded), every later entry
    is accepted drafts + 1 (the bonus token). NaN when no run has a step.
    """
    steps = [n for run in runs for n in acceptance_steps(run)]
    return sum(steps) / len(steps) if steps else math.nan


def acceptance_histogram(runs: Iterable[Sequence[int]], max_length: int | None = None) -> dict[int, int]:
    """How many verification steps committed 1, 2, ... tokens (prefill excluded), pooled over runs.

    With `max_length`, every length 1..max_length appears (zeros included) and longer steps count at `max_length`.
    """
    counts: dict[int, int] = {}
    for run in runs:
        for n in acceptance_steps(run):
            if max_length is not None:
                n = min(n, max_length)
            counts[n] = counts.get(n, 0) + 1
    if max_length is not None:
        for n in range(1, max_length + 1):
            counts.setdefault(n, 0)
    return dict(sorted(counts.items()))


def overhead_ratio(tau: float, speedup_value: float) -> float:
    """r = tau / speedup: the cost of one speculative step in units of one plain decoding step (1.0 is ideal)."""
    if not speedup_value or not math.isfinite(speedup_value) or not math.isfinite(tau):
        return math.nan
    return tau / speedup_value


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Sample:
    """One timed run of one method on one prompt."""

    method: str
    dataset: str
    temperature: float
    prompt_index: int  # index in the dataset's prompt list
    repeat: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    acceptance: list[int] | None = None  # tokens per target forward, prefill first (None: not measured)
    output: list[int] = field(default_factory=list, repr=False)  # the new token ids

    def to_dict(self, with_output: bool = False) -> dict:
        data = asdict(self)
        output = data.pop("output")
        data["output_sha1"] = hashlib.sha1(json.dumps(output).encode()).hexdigest()[:12]
        if with_output:
            data["output"] = output
        return data


def find_mismatches(samples: Iterable[Sample], baseline: str = "baseline") -> list[dict]:
    """Greedy runs whose new tokens differ from the baseline's on the same dataset and prompt.

    Returns one dict per mismatching run: dataset, prompt_index, method, repeat, position of the first difference and
    the two token counts. Baseline repeats that disagree with the first baseline run are flagged too (that would be
    non-determinism in the target itself). Sampling runs (temperature > 0) are not compared.
    """
    samples = [s for s in samples if s.temperature == 0]
    reference: dict[tuple[str, int], Sample] = {}
    for s in samples:
        if s.method == baseline:
            reference.setdefault((s.dataset, s.prompt_index), s)
    mismatches = []
    for s in samples:
        ref = reference.get((s.dataset, s.prompt_index))
        if ref is None or s is ref:
            continue
        position = first_difference(s.output, ref.output)
        if position is not None:
            mismatches.append(
                {
                    "dataset": s.dataset,
                    "prompt_index": s.prompt_index,
                    "method": s.method,
                    "repeat": s.repeat,
                    "first_difference": position,
                    "new_tokens": s.new_tokens,
                    "baseline_new_tokens": ref.new_tokens,
                }
            )
    return mismatches


def summarize(
    samples: Sequence[Sample],
    baseline: str = "baseline",
    max_length: int | None = None,
    mismatches: Sequence[dict] | None = None,
) -> list[dict]:
    """One row per (temperature, dataset, method), plus dataset "all" rows when there are several datasets.

    Rates are totals over the runs (total new tokens / total seconds), so long answers weigh more, as in a serving
    log. speedup is relative to the baseline row of the same temperature and dataset; tau, its histogram and r pool
    the verification steps of all runs (baseline: tau = 1 by definition).
    """
    mismatches = find_mismatches(samples, baseline) if mismatches is None else mismatches
    temperatures = sorted({s.temperature for s in samples})
    datasets = list(dict.fromkeys(s.dataset for s in samples))
    methods = list(dict.fromkeys(s.method for s in samples))
    groups = [(t, d) for t in temperatures for d in datasets]
    if len(datasets) > 1:
        groups += [(t, "all") for t in temperatures]
    rows = []
    for temperature, dataset in groups:
        def pick(method):
            return [
                s for s in samples
                if s.temperature == temperature and s.method == method and dataset in ("all", s.dataset)
            ]

        base = pick(baseline)
        base_rate = tokens_per_second(sum(s.new_tokens for s in base), sum(s.seconds for s in base))
        for method in methods:
            runs = pick(method)
            if not runs:
                continue
            tokens, seconds = sum(s.new_tokens for s in runs), sum(s.seconds for s in runs)
            rate = tokens_per_second(tokens, seconds)
            gain = speedup(rate, base_rate)
            if method == baseline:
                tau, histogram = 1.0, ({1: tokens} if tokens else {})
            elif all(s.acceptance is not None for s in runs):
                accepted = [s.acceptance for s in runs]
                tau, histogram = mean_acceptance_length(accepted), acceptance_histogram(accepted, max_length)
            else:
                tau, histogram = math.nan, {}
            rows.append(
                {
                    "temperature": temperature,
                    "dataset": dataset,
                    "method": method,
                    "runs": len(runs),
                    "prompts": len({(s.dataset, s.prompt_index) for s in runs}),
                    "new_tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": rate,
                    "tpot_ms": time_per_output_token_ms(tokens, seconds),
                    "speedup": gain,
                    "tau": tau,
                    "acceptance_histogram": histogram,
                    "r": overhead_ratio(tau, gain),
                    "mismatches": sum(
                        1 for m in mismatches
                        if temperature == 0 and m["method"] == method and dataset in ("all", m["dataset"])
                    ),
                }
            )
    return rows


def relative_rate(rows: Sequence[dict], method: str, other: str) -> list[dict]:
    """`method`'s token rate over `other`'s, per (temperature, dataset) where both ran (e.g. ours vs built-in)."""
    index = {(r["temperature"], r["dataset"], r["method"]): r for r in rows}
    out = []
    for (temperature, dataset, name), row in index.items():
        if name != method or (temperature, dataset, other) not in index:
            continue
        other_row = index[(temperature, dataset, other)]
        out.append(
            {
                "temperature": temperature,
                "dataset": dataset,
                "ratio": speedup(row["tokens_per_s"], other_row["tokens_per_s"]),
                "tau": row["tau"],
                "other_tau": other_row["tau"],
            }
        )
    return out


# ======================================================================================================================
# transformers' built-in DFlash drafter, with our weights
# ======================================================================================================================


def builtin_dflash_available() -> tuple[bool, str]:
    """Whether the installed transformers has the `speculation_type="dflash"` path and its drafter class."""
    try:
        import transformers
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
        from transformers.models.muse_glimmer_assistant import modeling_muse_glimmer_assistant  # noqa: F401
    except ImportError:
        import transformers

        return False, (
            f"transformers {transformers.__version__} has no built-in DFlash path "
            "(DFlashTokenCandidateGenerator / muse_glimmer_assistant arrive in 5.x)"
        )
    return True, f"transformers {transformers.__version__}"


def builtin_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our (released DFlash) parameter names -> `MuseGlimmerAssistantModel`'s: `fc` and `hidden_norm` live in its
    `encoder` (as `encoder.fc` and `encoder.output_norm_enc`); `layers.*` and `norm` keep their names. A reduced draft
    vocabulary (`draft_vocab_ids`) has no counterpart there: the built-in path drafts from the whole vocabulary."""
    return {
        BUILTIN_DRAFTER_RENAMES.get(name, name): tensor for name, tensor in state_dict.items() if name != "draft_vocab_ids"
    }


def to_builtin_drafter(drafter):
    """A transformers `MuseGlimmerAssistantModel` with `drafter`'s exact weights and settings, for
    `target.generate(assistant_model=..., speculation_type="dflash")`. Same device, dtype and attention backend.

    The two architectures are the same computation (Qwen3-style layers with q/k-norm, KV injection of the fused
    target features, non-causal block); only the places of `fc`/`hidden_norm` and the config class differ.
    """
    import torch

    available, reason = builtin_dflash_available()
    if not available:
        raise RuntimeError(reason)
    from transformers.models.muse_glimmer_assistant.configuration_muse_glimmer_assistant import (
        MuseGlimmerAssistantConfig,
    )
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

    c = drafter.config
    if getattr(c, "attention_bias", False):
        raise ValueError("transformers' built-in DFlash drafter has no attention biases; this drafter has some.")
    rope = dict(c.rope_parameters)
    config = MuseGlimmerAssistantConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=c.sliding_window if c.sliding_window is not None else c.max_position_embeddings,
        layer_types=list(c.layer_types),
        attention_dropout=c.attention_dropout,
        hidden_act=c.hidden_act,
        bos_token_id=c.bos_token_id if isinstance(c.bos_token_id, int) else None,
        eos_token_id=c.eos_token_id if isinstance(c.eos_token_id, int) else None,
        pad_token_id=None,
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids),
    )
    config._attn_implementation = getattr(c, "_attn_implementation", None) or "sdpa"
    param = next(drafter.parameters())
    with torch.device(param.device):
        model = MuseGlimmerAssistantModel(config)
    # Cast the parameters only, as `from_pretrained(dtype=...)` would: the RoPE `inv_freq` buffer stays float32
    # (`model.to(torch.bfloat16)` would round it, and the angles would drift at long positions). Casting before
    # loading keeps float64 weights exact.
    for p in model.parameters():
        p.data = p.data.to(param.dtype)
    model.load_state_dict(builtin_state_dict(drafter.state_dict()), strict=True)
    return model.eval()


# ======================================================================================================================
# Methods
# ======================================================================================================================


@dataclass
class Method:
    """A decoding method: `generate(input_ids, kwargs) -> (sequences [1, prompt + new], acceptance or None)`.

    `kwargs` are the common `generate()` arguments (attention mask, max_new_tokens, sampling settings, pad id).
    acceptance: tokens committed per target forward, prefill first, like `drafter.last_acceptance_lengths`.
    """

    name: str
    label: str
    generate: Callable[[Any, dict], tuple[Any, list[int] | None]]
    note: str = ""


class _AssistedRecorder:
    """Records, for transformers' own assisted loop, the tokens committed per target forward (n_matches + 1) and
    optionally each step's drafts, by wrapping the candidate generator `generate()` builds for one call."""

    def __init__(self, record_drafts: bool = False):
        self.acceptance: list[int] = []
        self.drafts: list[list[int]] = []
        self.record_drafts = record_drafts

    @contextlib.contextmanager
    def watch(self):
        from transformers.generation.utils import GenerationMixin

        original = GenerationMixin._get_candidate_generator
        recorder = self

        @functools.wraps(original)
        def get_candidate_generator(model, *args, **kwargs):
            generator = original(model, *args, **kwargs)
            update = generator.update_candidate_strategy

            def update_candidate_strategy(input_ids, scores, num_matches):
                recorder.acceptance.append(int(num_matches) + 1)
                return update(input_ids, scores, num_matches)

            generator.update_candidate_strategy = update_candidate_strategy
            if recorder.record_drafts:
                get_candidates = generator.get_candidates

                def recorded_get_candidates(input_ids, *a, **k):
                    candidates, logits = get_candidates(input_ids, *a, **k)
                    recorder.drafts.append(candidates[0, input_ids.shape[1] :].tolist())
                    return candidates, logits

                generator.get_candidates = recorded_get_candidates
            return generator

        GenerationMixin._get_candidate_generator = get_candidate_generator
        try:
            yield self
        finally:
            GenerationMixin._get_candidate_generator = original


@contextlib.contextmanager
def drafter_setting(drafter, name: str, value, default):
    """Temporarily set the run-time setting `drafter.<name>` to `value`.

    A drafter whose code predates the setting behaves as `default`: asking it for `default` changes nothing, asking it
    for anything else is an error (the method cannot run with that drafter)."""
    if not hasattr(drafter, name):
        if value == default:
            yield drafter
            return
        raise ValueError(f"this drafter's code has no {name} setting (drafter.{name})")
    previous = getattr(drafter, name)
    setattr(drafter, name, value)
    try:
        yield drafter
    finally:
        setattr(drafter, name, previous)


def draft_length(drafter, setting):
    """Temporarily set `drafter.draft_length` ("full": verify the whole block; a threshold; "auto"; None: the device's
    default)."""
    return drafter_setting(drafter, "draft_length", setting, "full")


def fast_cpu_linears(drafter, enabled: bool):
    """Temporarily set `drafter.fast_cpu_linears` (False: verify and draft with stock `nn.Linear` kernels)."""
    return drafter_setting(drafter, "fast_cpu_linears", enabled, True)


def ngram_lookup(drafter, size):
    """Temporarily set `drafter.ngram_lookup` (0: off; None: the device's default)."""
    return drafter_setting(drafter, "ngram_lookup", size, 0)


def parse_draft_length(text):
    """`--draft-length` values: "auto", "full" (or "none": the whole block) or a confidence threshold in [0, 1]."""
    if text is None or str(text).lower() in ("none", "full"):
        return "full"
    if str(text).lower() == "auto":
        return "auto"
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"draft length threshold must be in [0, 1], got {value}")
    return value


def _with_cpu_kernels(target, generate: Callable) -> Callable:
    """`generate` with the CPU kernels DFlash decoding uses (`cpu_kernels`: skinny linears, packed attention)."""

    from .kernels import cpu_kernels

    def wrapped(ids, kw):
        with cpu_kernels(target):
            return generate(ids, kw)

    return wrapped


def _assisted(target, extra: dict) -> Callable:
    def generate(input_ids, kwargs):
        recorder = _AssistedRecorder()
        with recorder.watch():
            out = target.generate(input_ids, **kwargs, **extra)
        return out, recorder.acceptance

    return generate


def build_methods(
    target,
    drafter=None,
    names: Sequence[str] = DEFAULT_METHODS,
    *,
    builtin_drafter=None,
    prompt_lookup_tokens: int = 10,
    max_matching_ngram_size: int | None = None,
    early_exit_layer: int | None = None,
    assistant_model=None,
    adaptive_draft_length="auto",
) -> tuple[list[Method], dict[str, str]]:
    """The requested methods that can run here, and `{name: reason}` for those that cannot."""
    methods, skipped = [], {}

    def dflash_generate(setting, fast_linears=True, lookup=0):
        def generate(ids, kw):
            with draft_length(drafter, setting), fast_cpu_linears(drafter, fast_linears), ngram_lookup(drafter, lookup):
                out = target.generate(ids, assistant_model=drafter, **kw)
            return out, list(drafter.last_acceptance_lengths)

        return generate

    def plain(ids, kw):
        return target.generate(ids, **kw), None

    def prompt_lookup_extra():
        extra = {"prompt_lookup_num_tokens": prompt_lookup_tokens}
        if max_matching_ngram_size is not None:
            extra["max_matching_ngram_size"] = max_matching_ngram_size
        return extra, f"{prompt_lookup_tokens} tokens, n-gram <= {max_matching_ngram_size or 2}"

    for name in names:
        if name == "baseline":
            methods.append(Method(name, METHOD_LABELS[name], plain))
        elif name == "baseline_skinny":
            methods.append(Method(name, METHOD_LABELS[name], _with_cpu_kernels(target, plain)))
        elif name == "prompt_lookup_skinny":
            extra, note = prompt_lookup_extra()
            methods.append(Method(name, METHOD_LABELS[name], _with_cpu_kernels(target, _assisted(target, extra)), note))
        elif name == "dflash_lookup":
            if drafter is None or not hasattr(drafter, "ngram_lookup"):
                skipped[name] = "no drafter given" if drafter is None else "this drafter's code has no ngram_lookup"
                continue
            setting = adaptive_draft_length or "auto"
            methods.append(
                Method(name, METHOD_LABELS[name], dflash_generate(setting, lookup=max_matching_ngram_size or 2),
                       f"block {drafter.config.block_size}, draft_length={setting!r}, "
                       f"ngram_lookup={max_matching_ngram_size or 2}")
            )
        elif name == "dflash_stock_linears":
            if drafter is None or not hasattr(drafter, "fast_cpu_linears"):
                skipped[name] = "no drafter given" if drafter is None else "this drafter's code has no fast_cpu_linears"
                continue
            methods.append(
                Method(name, METHOD_LABELS[name], dflash_generate("full", fast_linears=False),
                       f"block {drafter.config.block_size}, fast_cpu_linears=False")
            )
        elif name == "dflash":
            if drafter is None:
                skipped[name] = "no drafter given"
                continue
            block = f"block {drafter.config.block_size}"
            methods.append(Method(name, METHOD_LABELS[name], dflash_generate("full"), block))
        elif name == "dflash_adaptive":
            if drafter is None:
                skipped[name] = "no drafter given"
                continue
            if not hasattr(drafter, "draft_length"):
                skipped[name] = "this drafter's code has no adaptive draft length"
                continue
            methods.append(
                Method(name, METHOD_LABELS[name], dflash_generate(adaptive_draft_length),
                       f"block {drafter.config.block_size}, draft_length={adaptive_draft_length!r}")
            )
        elif name == "builtin_dflash":
            available, reason = builtin_dflash_available()
            if drafter is None:
                skipped[name] = "no drafter given"
                continue
            if not available:
                skipped[name] = reason
                continue
            converted = builtin_drafter if builtin_drafter is not None else to_builtin_drafter(drafter)
            methods.append(
                Method(
                    name,
                    METHOD_LABELS[name],
                    _assisted(target, {"assistant_model": converted, "speculation_type": "dflash"}),
                    f"{reason}, MuseGlimmerAssistantModel with the same weights",
                )
            )
        elif name == "prompt_lookup":
            extra, note = prompt_lookup_extra()
            methods.append(Method(name, METHOD_LABELS[name], _assisted(target, extra), note))
        elif name == "early_exit":
            num_layers = _num_target_layers(target)
            layer = early_exit_layer if early_exit_layer is not None else max(1, num_layers // 4)
            if not 0 < layer < num_layers:
                skipped[name] = f"early-exit layer {layer} is not within 1..{num_layers - 1}"
                continue
            methods.append(
                Method(
                    name,
                    METHOD_LABELS[name],
                    _assisted(target, {"assistant_early_exit": layer}),
                    f"drafts with the target's first {layer} of {num_layers} layers",
                )
            )
        elif name == "assistant":
            if assistant_model is None:
                skipped[name] = "no --assistant-model given"
                continue
            methods.append(
                Method(
                    name,
                    METHOD_LABELS[name],
                    _assisted(target, {"assistant_model": assistant_model}),
                    type(assistant_model).__name__,
                )
            )
        else:
            raise ValueError(f"unknown method {name!r}; choose from {DEFAULT_METHODS + OPTIONAL_METHODS}")
    return methods, skipped


def _num_target_layers(target) -> int:
    from .target_model import text_config

    config = text_config(target.config)
    return int(config.num_hidden_layers)


# ======================================================================================================================
# Draft-for-draft comparison of the two DFlash paths
# ======================================================================================================================


def core_module(drafter, name: str):
    """The core file `name` of the copy of the core that `drafter`'s class comes from (ours, or a checkpoint's
    own under trust_remote_code)."""
    package = sys.modules[type(drafter).__module__].__package__
    return sys.modules[f"{package}.{name}"]


@contextlib.contextmanager
def _record_our_drafts(drafter, store: list):
    generator_class = core_module(drafter, "candidate_generator").DFlashCandidateGenerator
    original = generator_class.draft

    @functools.wraps(original)
    def draft(self, *args, **kwargs):
        drafts, confidence = original(self, *args, **kwargs)
        store.append(drafts[0].tolist())
        return drafts, confidence

    generator_class.draft = draft
    try:
        yield store
    finally:
        generator_class.draft = original


def compare_drafts(target, drafter, builtin_drafter, input_ids, max_new_tokens: int = 64, **generate_kwargs) -> dict:
    """Greedy-decode `input_ids` through both DFlash paths and compare their proposals step by step.

    Both paths start a step from the same verified context when all earlier drafts agreed, so equal drafts at every
    step mean the two drafters compute the same function. Near the end our path drafts only what still fits
    (`max_new_tokens`) while the built-in one always drafts `block_size - 1` and crops afterwards: a step counts as
    equal when our drafts are a prefix of the built-in's.
    """
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
    kwargs.update(generate_kwargs)
    ours: list[list[int]] = []
    with torch.inference_mode(), _record_our_drafts(drafter, ours), draft_length(drafter, "full"), \
            ngram_lookup(drafter, 0):
        ours_out = target.generate(input_ids, assistant_model=drafter, **kwargs)
    ours_acceptance = list(drafter.last_acceptance_lengths)
    recorder = _AssistedRecorder(record_drafts=True)
    with torch.inference_mode(), recorder.watch():
        builtin_out = target.generate(input_ids, assistant_model=builtin_drafter, speculation_type="dflash", **kwargs)
    theirs = [d for d in recorder.drafts if d]  # the built-in loop's prefill call proposes nothing
    steps = min(len(ours), len(theirs))
    equal = [ours[i] == theirs[i][: len(ours[i])] for i in range(steps)]
    first = next((i for i, ok in enumerate(equal) if not ok), None)
    detail = None
    if first is not None:
        detail = {"step": first, "ours": ours[first], "builtin": theirs[first]}
    return {
        "steps_compared": steps,
        "steps_equal": sum(equal),
        "ours_steps": len(ours),
        "builtin_steps": len(theirs),
        "first_difference": detail,
        "outputs_equal": ours_out[0].tolist() == builtin_out[0].tolist(),
        "ours_acceptance": ours_acceptance,
        "builtin_acceptance": recorder.acceptance,
        "all_equal": first is None and len(ours) == len(theirs),
    }


# ======================================================================================================================
# Where a speculative step's time goes
# ======================================================================================================================


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
            _synchronize(profiler.device)
            frame = [time.perf_counter(), 0.0]  # start, time spent in nested wrapped calls
            profiler._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                _synchronize(profiler.device)
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
        _synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _synchronize(self.device)
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


def profile_step(target, drafter, input_ids, kind: str = "dflash", builtin_drafter=None, max_new_tokens: int = 64,
                 adaptive_draft_length="auto", **generate_kwargs) -> dict:
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
    recorder = _AssistedRecorder()
    try:
        with torch.inference_mode(), draft_length(drafter, setting), ngram_lookup(drafter, 0), recorder.watch(), \
                StepProfiler(target, "builtin_dflash" if kind == "builtin_dflash" else "dflash", drafter) as profiler:
            target.generate(input_ids, **kwargs, **extra)
    finally:
        handle.remove()
    out = profiler.breakdown()
    acceptance = recorder.acceptance if kind == "builtin_dflash" else list(drafter.last_acceptance_lengths)
    out["mean_verified_width"] = sum(widths[1:]) / len(widths[1:]) if len(widths) > 1 else math.nan
    out["tau"] = mean_acceptance_length([acceptance])
    return out


# ======================================================================================================================
# The benchmark loop
# ======================================================================================================================


def _synchronize(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def encode_prompt(tokenizer, prompt, device):
    """[1, seq] ids of one prompt: token ids as given, or text through the tokenizer's chat template."""
    import torch

    if isinstance(prompt, torch.Tensor):
        ids = prompt if prompt.dim() == 2 else prompt[None]
        return ids.to(device)
    if not isinstance(prompt, str):
        return torch.tensor([list(prompt)], device=device)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass tokenizer=... or token id lists")
    from .cli import encode_chat

    return encode_chat(tokenizer, prompt, device)


def _generate_kwargs(input_ids, max_new_tokens: int, temperature: float, pad_token_id) -> dict:
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


class _NoProgress:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def _progress_bar(enabled: bool, total: int):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc="dflash bench", unit="run", dynamic_ncols=True, file=sys.stderr)


def run_benchmark(
    target,
    drafter=None,
    *,
    datasets: Mapping[str, Sequence[Any]],
    tokenizer=None,
    methods: Sequence[str] = DEFAULT_METHODS,
    extra_methods: Sequence[Method] = (),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 64,
    repeats: int = 1,
    warmup: int = 1,
    seed: int = 0,
    prompt_lookup_tokens: int = 10,
    max_matching_ngram_size: int | None = None,
    early_exit_layer: int | None = None,
    assistant_model=None,
    adaptive_draft_length="auto",
    check_drafts: bool = True,
    profile: bool = False,
    progress: bool = True,
    drafter_description: str | None = None,
    drafter_trained: bool | None = None,
    settings: Mapping[str, Any] | None = None,
) -> dict:
    """Time every method on every prompt of every dataset, at every temperature, in this one process.

    datasets: `{name: prompts}`; a prompt is text (the tokenizer's chat template is applied) or token ids.
    methods: names among `DEFAULT_METHODS + OPTIONAL_METHODS`; `baseline` is always run (speedups need it).
    extra_methods: more `Method`s (e.g. your own decoding loop), timed and checked like the others.
    Per temperature, every method first runs `warmup` untimed times on the first prompt; then, prompt by prompt,
    each method runs `repeats` timed times, interleaved, in an order rotated from prompt to prompt. Sampling
    (temperature > 0: pure sampling, top_k=0, top_p=1) reseeds torch with the same seed for every method.

    Returns the report: settings, environment, methods, skipped methods, samples, summary rows, mismatches,
    ours-vs-built-in comparisons and notes; `write_report` turns it into JSON, Markdown and PNG.
    """
    import torch

    names = list(dict.fromkeys(["baseline", *methods]))
    builtin_drafter = None
    if drafter is not None and "builtin_dflash" in names and builtin_dflash_available()[0]:
        builtin_drafter = to_builtin_drafter(drafter)
    method_list, skipped = build_methods(
        target,
        drafter,
        names,
        builtin_drafter=builtin_drafter,
        prompt_lookup_tokens=prompt_lookup_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
        early_exit_layer=early_exit_layer,
        assistant_model=assistant_model,
        adaptive_draft_length=adaptive_draft_length,
    )
    method_list += list(extra_methods)
    taken = [m.name for m in method_list]
    if len(set(taken)) != len(taken):
        raise ValueError(f"method names must be unique, got {taken}")

    device = next(target.parameters()).device
    pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if pad_token_id is None:
        eos = target.generation_config.eos_token_id
        pad_token_id = target.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    encoded = {name: [encode_prompt(tokenizer, p, device) for p in prompts] for name, prompts in datasets.items()}
    encoded = {name: ids for name, ids in encoded.items() if ids}
    if not encoded:
        raise ValueError("no prompts to benchmark")
    temperatures = [float(t) for t in temperatures]
    num_prompts = sum(len(v) for v in encoded.values())
    check = check_drafts and builtin_drafter is not None and any(
        m.name in ("dflash", "builtin_dflash") for m in method_list
    )
    to_profile = [m.name for m in method_list if m.name in ("dflash", "dflash_adaptive", "builtin_dflash")] if profile else []
    if "builtin_dflash" in to_profile and builtin_drafter is None:
        to_profile.remove("builtin_dflash")
    total = len(temperatures) * len(method_list) * (warmup + repeats * num_prompts) + (1 if check else 0)
    total += len(to_profile)
    bar = _progress_bar(progress, total)

    def timed(method, ids, temperature, sample_seed):
        kwargs = _generate_kwargs(ids, max_new_tokens, temperature, pad_token_id)
        if temperature > 0:
            torch.manual_seed(sample_seed)
        _synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out, acceptance = method.generate(ids, kwargs)
        _synchronize(device)
        seconds = time.perf_counter() - start
        sequences = out.sequences if hasattr(out, "sequences") else out
        return sequences[0, ids.shape[1] :].tolist(), acceptance, seconds

    samples: list[Sample] = []
    rotation = 0
    started = time.perf_counter()
    try:
        for temperature in temperatures:
            first_ids = next(iter(encoded.values()))[0]
            for method in method_list:
                for _ in range(warmup):
                    bar.set_postfix_str(f"warm-up {method.name} T={temperature:g}")
                    timed(method, first_ids, temperature, seed)
                    bar.update()
            for dataset, prompts in encoded.items():
                for index, ids in enumerate(prompts):
                    order = method_list[rotation % len(method_list) :] + method_list[: rotation % len(method_list)]
                    rotation += 1
                    for repeat in range(repeats):
                        for method in order:
                            bar.set_postfix_str(f"{dataset} #{index} {method.name} T={temperature:g}")
                            output, acceptance, seconds = timed(
                                method, ids, temperature, seed * 1_000_003 + index * 101 + repeat
                            )
                            samples.append(
                                Sample(
                                    method=method.name,
                                    dataset=dataset,
                                    temperature=temperature,
                                    prompt_index=index,
                                    repeat=repeat,
                                    prompt_tokens=int(ids.shape[1]),
                                    new_tokens=len(output),
                                    seconds=seconds,
                                    acceptance=list(acceptance) if acceptance is not None else None,
                                    output=output,
                                )
                            )
                            bar.update()
        draft_check = None
        if check:
            bar.set_postfix_str("ours vs built-in drafts")
            draft_check = compare_drafts(
                target, drafter, builtin_drafter, next(iter(encoded.values()))[0], max_new_tokens,
                pad_token_id=pad_token_id,
            )
            bar.update()
        profiles = {}
        for name in to_profile:
            bar.set_postfix_str(f"profiling {name}")
            profiles[name] = profile_step(
                target, drafter, next(iter(encoded.values()))[0], name, builtin_drafter, max_new_tokens,
                adaptive_draft_length, pad_token_id=pad_token_id,
            )
            bar.update()
    finally:
        bar.close()
    elapsed = time.perf_counter() - started

    block_size = getattr(getattr(drafter, "config", None), "block_size", None)
    max_len = max([block_size or 1] + [prompt_lookup_tokens + 1] + [n for s in samples for n in (s.acceptance or [1])])
    mismatches = find_mismatches(samples)
    rows = summarize(samples, max_length=max_len, mismatches=mismatches)
    notes = []
    if drafter is not None and drafter_trained is False:
        notes.append(UNTRAINED_NOTE)
    if mismatches:
        notes.append(
            f"{len(mismatches)} greedy run(s) differ from plain generate(): see `mismatches`. In float32/bfloat16 a "
            "block verification may round differently from one-token decoding and flip a near-tie; in float64 any "
            "difference is a bug."
        )
    if builtin_drafter is not None and getattr(drafter, "draft_vocab_ids", None) is not None:
        notes.append(
            f"The drafter drafts from a reduced vocabulary ({drafter.config.draft_vocab_size} tokens); transformers' "
            "built-in DFlash path has no such option, so it gets the same layer weights but scores the whole "
            "vocabulary: its drafts (and tau) can differ from ours, and its draft step pays for the full LM head."
        )
    if "builtin_dflash" in skipped:
        notes.append(f"transformers' built-in DFlash path was not run: {skipped['builtin_dflash']}.")
    report = {
        "settings": {
            "datasets": {name: len(ids) for name, ids in encoded.items()},
            "methods": [m.name for m in method_list],
            "temperatures": temperatures,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "prompt_lookup_tokens": prompt_lookup_tokens,
            "block_size": block_size,
            "adaptive_draft_length": adaptive_draft_length,
            "drafter": drafter_description,
            "drafter_trained": drafter_trained,
            **dict(settings or {}),
        },
        "environment": environment(device),
        "methods": {m.name: {"label": m.label, "note": m.note} for m in method_list},
        "skipped": skipped,
        "summary": rows,
        "comparisons": [
            {"method": ours, "other": other, "rows": relative_rate(rows, ours, other)}
            for other in ("builtin_dflash", "prompt_lookup")
            for ours in ("dflash", "dflash_adaptive", "dflash_lookup")
            if relative_rate(rows, ours, other)
        ],
        "draft_check": draft_check,
        "step_profile": profiles,
        "mismatches": mismatches,
        "notes": notes,
        "elapsed_s": elapsed,
        "samples": [s.to_dict() for s in samples],
    }
    return report


# ======================================================================================================================
# Batched throughput: many prompts per generate() call
# ======================================================================================================================


def left_pad(prompts: Sequence[Any], pad_token_id: int, device=None):
    """`(input_ids, attention_mask)` of 1-D (or `[1, L]`) id tensors, left-padded to the longest."""
    import torch

    rows = [p.flatten() for p in prompts]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = row.cpu()
        attention_mask[i, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def generated_lengths(new_tokens, eos_token_ids: Sequence[int]) -> list[int]:
    """Per row of `new_tokens` `[batch, n]`: tokens generated up to and including the first EOS (padding after a
    row's end is not generated work)."""
    lengths = []
    for row in new_tokens.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        lengths.append(end)
    return lengths


def batch_acceptance_length(acceptance_per_row: Sequence[Sequence[int]]) -> float:
    """tau of a batched call: tokens committed per row and verification step, prefill entries excluded.

    Takes `drafter.last_acceptance_lengths`: one list per row, or a single flat list for a batch of one."""
    if acceptance_per_row and not isinstance(acceptance_per_row[0], (list, tuple)):
        acceptance_per_row = [acceptance_per_row]
    steps = [n for row in acceptance_per_row for n in acceptance_steps(row)]
    return sum(steps) / len(steps) if steps else float("nan")


def run_batch_benchmark(
    target,
    drafter,
    prompts: Sequence[Any],
    *,
    batch_sizes: Sequence[int] = (1, 4, 8, 16),
    max_new_tokens: int = 64,
    repeats: int = 1,
    warmup: int = 1,
    pad_token_id: int | None = None,
    adaptive_draft_length=None,
    progress: bool = True,
    methods: Sequence[str] | None = None,
) -> list[dict]:
    """Throughput of plain batched `generate()` against batched DFlash (greedy), batch size by batch size.

    methods: among `BATCH_METHODS` (default: baseline, dflash, and dflash_adaptive when `adaptive_draft_length` is
    given); baseline always runs first. `baseline_skinny` / `dflash_stock_linears` attribute speed to kernels.

    prompts: 1-D id tensors (chat template already applied); batch size B takes the first B (cycling if fewer).
    Per batch size, each method runs `warmup` untimed calls, then `repeats` timed calls interleaved with the others.
    Throughput is generated tokens (each row up to its first EOS) over wall time. Every row's output is compared with
    plain batched generate()'s, which must be equal row by row (greedy).

    Returns one row per (batch size, method): tokens/s, speedup over plain, tau, tokens, seconds, rows equal.
    """
    import torch

    device = next(target.parameters()).device
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if pad_token_id is None:
        pad_token_id = target.generation_config.pad_token_id
        pad_token_id = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    from .kernels import cpu_kernels

    if methods is None:
        methods = ["dflash"] + (["dflash_adaptive"] if adaptive_draft_length is not None else [])
    unknown = sorted(set(methods) - set(BATCH_METHODS))
    if unknown:
        raise ValueError(f"batched benchmark methods {unknown} are not among {BATCH_METHODS}")
    if adaptive_draft_length is None and {"dflash_adaptive", "dflash_lookup"} & set(methods):
        adaptive_draft_length = "auto"
    methods = [
        (name, adaptive_draft_length if name in ("dflash_adaptive", "dflash_lookup") else "full")
        for name in dict.fromkeys(["baseline", *methods])
    ]
    bar = _progress_bar(progress, len(batch_sizes) * len(methods) * (warmup + repeats))
    rows: list[dict] = []
    try:
        for batch_size in batch_sizes:
            chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
            input_ids, attention_mask = left_pad(chosen, pad_token_id, device)
            kwargs = dict(attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad_token_id)
            totals = {name: {"tokens": 0, "seconds": 0.0, "steps": [], "equal": True} for name, _ in methods}
            reference = None

            def call(name, setting):
                extra = {}
                with contextlib.ExitStack() as settings:
                    if name == "baseline_skinny":
                        settings.enter_context(cpu_kernels(target))
                    elif name != "baseline":
                        settings.enter_context(draft_length(drafter, setting))
                        settings.enter_context(fast_cpu_linears(drafter, name != "dflash_stock_linears"))
                        settings.enter_context(ngram_lookup(drafter, 2 if name == "dflash_lookup" else 0))
                        extra["assistant_model"] = drafter
                    _synchronize(device)
                    start = time.perf_counter()
                    with torch.inference_mode():
                        out = target.generate(input_ids, **kwargs, **extra)
                    _synchronize(device)
                    return out[:, input_ids.shape[1] :], time.perf_counter() - start

            for name, setting in methods:
                for _ in range(warmup):
                    bar.set_postfix_str(f"warm-up batch {batch_size} {name}")
                    new, _ = call(name, setting)
                    reference = new if name == "baseline" else reference
                    bar.update()
            for repeat in range(repeats):
                order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
                for name, setting in order:
                    bar.set_postfix_str(f"batch {batch_size} {name}")
                    new, seconds = call(name, setting)
                    lengths = generated_lengths(new, eos_ids)
                    total = totals[name]
                    total["tokens"] += sum(lengths)
                    total["seconds"] += seconds
                    if name == "baseline" and reference is None:
                        reference = new
                    if reference is not None:
                        ref_lengths = generated_lengths(reference, eos_ids)
                        total["equal"] &= all(
                            n == m and new[i, :n].tolist() == reference[i, :m].tolist()
                            for i, (n, m) in enumerate(zip(lengths, ref_lengths))
                        )
                    if name not in PLAIN_METHODS:
                        total["steps"].append(batch_acceptance_length(drafter.last_acceptance_lengths))
                    bar.update()
            base_rate = tokens_per_second(totals["baseline"]["tokens"], totals["baseline"]["seconds"])
            for name, _ in methods:
                total = totals[name]
                rate = tokens_per_second(total["tokens"], total["seconds"])
                taus = [t for t in total["steps"] if math.isfinite(t)]
                rows.append({
                    "batch_size": batch_size,
                    "method": name,
                    "tokens_per_s": rate,
                    "speedup": speedup(rate, base_rate),
                    "tau": sum(taus) / len(taus) if taus else (1.0 if name in PLAIN_METHODS else float("nan")),
                    "tokens": total["tokens"],
                    "seconds": total["seconds"],
                    "rows_equal": total["equal"],
                })
    finally:
        bar.close()
    return rows


def format_batch_markdown(rows: Sequence[Mapping[str, Any]], header: str = "") -> str:
    """The batched-throughput table."""
    lines = ["## DFlash batched throughput (greedy)", ""]
    if header:
        lines += [header, ""]
    lines += [
        "| batch size | method | tokens/s (whole batch) | speedup | tau | generated tokens | seconds | rows equal plain |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {METHOD_LABELS.get(r['method'], r['method'])} | {_fmt(r['tokens_per_s'], '.1f')} | "
            f"{_fmt(r['speedup'], '.2f')}x | {_fmt(r['tau'], '.2f')} | {r['tokens']} | {r['seconds']:.1f} | "
            f"{'yes' if r['rows_equal'] else 'NO'} |"
        )
    lines += [
        "",
        "tokens/s: tokens generated by all rows (each up to its first EOS) over wall time; speedup over plain batched "
        "generate() at the same batch size; tau: tokens committed per row and verification step.",
        "",
    ]
    return "\n".join(lines)


def run_linear_benchmark(model, row_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 5,
                         warmup: int = 1) -> list[dict]:
    """Time one pass over every `nn.Linear` weight of `model` (a forward's matrix products, in order) with
    `F.linear` and with `kernels.skinny_linear`, for inputs of each row count.

    The two kernels alternate pass by pass, so machine noise hits both alike. The weights are read from memory as in a
    real forward (a model's weights do not fit in the CPU caches). Returns one row per row count: milliseconds per
    pass for each kernel, their ratio, and each kernel's cost relative to `F.linear` on one row.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    from .kernels import skinny_linear

    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to time.")
    device = weights[0][0].device
    rows = []
    with torch.inference_mode():
        inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype, device=device)
                  for n in row_counts for w, _ in weights}

        def one_pass(kernel, n):
            _synchronize(device)
            start = time.perf_counter()
            for weight, bias in weights:
                kernel(inputs[n, weight.shape[1]], weight, bias)
            _synchronize(device)
            return time.perf_counter() - start

        for n in row_counts:
            for _ in range(warmup):
                one_pass(F.linear, n), one_pass(skinny_linear, n)
            stock = skinny = 0.0
            for _ in range(repeats):
                stock += one_pass(F.linear, n)
                skinny += one_pass(skinny_linear, n)
            rows.append({"rows": n, "linear_ms": stock / repeats * 1e3, "skinny_ms": skinny / repeats * 1e3})
    one_row = rows[0]["linear_ms"] if rows and rows[0]["rows"] == 1 else math.nan
    for row in rows:
        row["skinny_over_linear"] = row["skinny_ms"] / row["linear_ms"]
        row["linear_vs_one_row"] = row["linear_ms"] / one_row
        row["skinny_vs_one_row"] = row["skinny_ms"] / one_row
    return rows


def format_linear_markdown(rows: Sequence[Mapping[str, Any]], header: str = "") -> str:
    lines = ["## Linear kernels: one pass over the model's nn.Linear weights", ""]
    if header:
        lines += [header, ""]
    lines += [
        "| rows | F.linear (ms) | skinny_linear (ms) | skinny / F.linear | F.linear vs 1 row | skinny vs 1-row F.linear |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['linear_ms']:.1f} | {r['skinny_ms']:.1f} | {_fmt(r['skinny_over_linear'], '.2f')} | "
            f"{_fmt(r['linear_vs_one_row'], '.2f')}x | {_fmt(r['skinny_vs_one_row'], '.2f')}x |"
        )
    lines += [
        "",
        "rows: tokens x batch rows of a forward (a verification step of width w at batch b has w*b rows). skinny_linear "
        "takes F.linear above 256 rows and for other dtypes/devices, so those rows time the same kernel twice; one row "
        "goes through its two-column product (two copies of the row).",
        "",
    ]
    return "\n".join(lines)


# ======================================================================================================================
# Environment, output files
# ======================================================================================================================


def _git_commit() -> dict:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device=None) -> dict:
    """Versions, device, threads and git commit, for the JSON report."""
    import torch
    import transformers

    from . import __version__

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_dflash": __version__,
        "device": str(device) if device is not None else "cpu",
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git": _git_commit(),
        "command": " ".join(sys.argv),
    }
    if device is not None and str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = getattr(flash_attn, "__version__", "installed")
    except ImportError:
        pass
    return env


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def format_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: settings, one table per temperature, acceptance histograms, checks, notes."""
    settings, env = report["settings"], report["environment"]
    labels = {name: info["label"] for name, info in report["methods"].items()}
    git = env.get("git") or {}
    lines = [
        "## DFlash benchmark",
        "",
        f"- command: `{env.get('command', '')}`",
        f"- target: {settings.get('target', 'n/a')}; drafter: {settings.get('drafter') or 'n/a'}",
        f"- datasets: {', '.join(f'{k} ({v} prompts)' for k, v in settings['datasets'].items())}; "
        f"max new tokens {settings['max_new_tokens']}; block size {settings.get('block_size')}; "
        f"repeats {settings['repeats']}; warm-up {settings['warmup']}; seed {settings['seed']}",
        f"- {env.get('device')} ({env.get('gpu') or env.get('cpu')}), {env.get('torch_threads')} torch thread(s), "
        f"dtype {settings.get('dtype', 'n/a')}, attention {settings.get('attn_implementation', 'n/a')}",
        f"- torch {env.get('torch')}, transformers {env.get('transformers')}, transformers-dflash "
        f"{env.get('transformers_dflash')}, commit {str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}",
        "",
    ]
    for note in report.get("notes", []):
        lines += [f"> **Note.** {note}", ""]
    rows = report["summary"]
    for temperature in sorted({r["temperature"] for r in rows}):
        kind = "greedy" if temperature == 0 else "sampling"
        lines += [
            f"### Temperature {temperature:g} ({kind})",
            "",
            "| dataset | method | tokens/s | TPOT (ms) | speedup | tau | r = tau/speedup | new tokens | mismatches |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if r["temperature"] != temperature:
                continue
            mismatch = "-" if temperature > 0 else str(r["mismatches"])
            lines.append(
                f"| {r['dataset']} | {labels.get(r['method'], r['method'])} | {_fmt(r['tokens_per_s'], '.1f')} | "
                f"{_fmt(r['tpot_ms'], '.1f')} | {_fmt(r['speedup'], '.2f')}x | {_fmt(r['tau'], '.2f')} | "
                f"{_fmt(r['r'], '.2f')} | {r['new_tokens']} | {mismatch} |"
            )
        lines.append("")
    for comparison in report.get("comparisons") or []:
        ours, other = labels.get(comparison["method"]), labels.get(comparison["other"])
        lines += [
            f"### {ours} vs {other}" + (" (same drafter weights)" if comparison["other"] == "builtin_dflash" else ""),
            "",
            f"| temperature | dataset | tokens/s ratio | tau {comparison['method']} | tau {comparison['other']} |",
            "|---:|---|---:|---:|---:|",
        ]
        for c in comparison["rows"]:
            lines.append(
                f"| {c['temperature']:g} | {c['dataset']} | {_fmt(c['ratio'], '.2f')}x | {_fmt(c['tau'], '.2f')} | "
                f"{_fmt(c['other_tau'], '.2f')} |"
            )
        lines.append("")
    hist_rows = [r for r in rows if r["method"] != "baseline" and r["acceptance_histogram"]
                 and (r["dataset"] == "all" or len(settings["datasets"]) == 1)]
    if hist_rows:
        width = max(max(r["acceptance_histogram"]) for r in hist_rows)
        lines += [
            "### Acceptance-length histograms (verification steps committing n tokens; prefill excluded)",
            "",
            "| T | method | " + " | ".join(str(n) for n in range(1, width + 1)) + " |",
            "|---:|---|" + "---:|" * width,
        ]
        for r in hist_rows:
            h = r["acceptance_histogram"]
            lines.append(
                f"| {r['temperature']:g} | {labels.get(r['method'], r['method'])} | "
                + " | ".join(str(h.get(n, 0)) for n in range(1, width + 1)) + " |"
            )
        lines.append("")
    check = report.get("draft_check")
    if check:
        verdict = "identical" if check["all_equal"] else "DIFFERENT"
        lines += [
            "### Draft-for-draft check: our drafter vs the converted built-in drafter (greedy, first prompt)",
            "",
            f"{verdict}: {check['steps_equal']}/{check['steps_compared']} steps proposed the same tokens "
            f"(ours {check['ours_steps']} steps, built-in {check['builtin_steps']}); outputs equal: "
            f"{check['outputs_equal']}.",
            "",
        ]
        if check["first_difference"]:
            d = check["first_difference"]
            lines += [f"First difference at step {d['step']}: ours {d['ours']} vs built-in {d['builtin']}.", ""]
    profiles = report.get("step_profile") or {}
    if profiles:
        lines += [
            "### Where a step's time goes (ms per verification step; greedy, first prompt, separate run)",
            "",
            "| method | draft | verify (target forward) | cache crop | accept/commit | other (Python) | step | prefill "
            "| verified width | tau |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, p in profiles.items():
            lines.append(
                f"| {labels.get(name, name)} | {p['draft_ms']:.1f} | {p['verify_ms']:.1f} | {p['cache_crop_ms']:.2f} | "
                f"{p['accept_commit_ms']:.2f} | {p['other_ms']:.1f} | {p['step_ms']:.1f} | {p['prefill_ms']:.1f} | "
                f"{_fmt(p.get('mean_verified_width'), '.1f')} | {_fmt(p.get('tau'), '.2f')} |"
            )
        lines.append("")
    if report.get("mismatches"):
        lines += ["### Greedy outputs that differ from plain generate()", "",
                  "| dataset | prompt | method | repeat | first differing token | new tokens (method / baseline) |",
                  "|---|---:|---|---:|---:|---|"]
        for m in report["mismatches"]:
            lines.append(
                f"| {m['dataset']} | {m['prompt_index']} | {labels.get(m['method'], m['method'])} | {m['repeat']} | "
                f"{m['first_difference']} | {m['new_tokens']} / {m['baseline_new_tokens']} |"
            )
        lines.append("")
    else:
        lines += ["Greedy check: every method's output equals plain generate()'s on every prompt.", ""]
    if report.get("skipped"):
        lines += ["Not run: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items()) + ".", ""]
    notes = {name: info["note"] for name, info in report["methods"].items() if info.get("note")}
    if notes:
        lines += ["Methods: " + "; ".join(f"{labels[k]}: {v}" for k, v in notes.items()) + ".", ""]
    lines += [
        "tokens/s and TPOT: total new tokens over total wall time (prefill included). speedup: tokens/s over plain "
        "generate()'s. tau: mean tokens committed per target forward after the prefill. r = tau / speedup: the cost "
        "of one speculative step in plain decoding steps (1.0 = no overhead).",
        "",
    ]
    return "\n".join(lines)


def plot_report(report: Mapping[str, Any], path: str | os.PathLike) -> bool:
    """PNG with the acceptance-length histograms and the speedup per dataset. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["summary"]
    labels = {name: info["label"] for name, info in report["methods"].items()}
    datasets = [d for d in report["settings"]["datasets"]]
    several = len(datasets) > 1
    temperatures = sorted({r["temperature"] for r in rows})
    methods = [m for m in report["methods"] if m != "baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))

    ax = axes[0]
    hist_rows = [r for r in rows if r["method"] in methods and r["temperature"] == temperatures[0]
                 and r["dataset"] == ("all" if several else datasets[0]) and r["acceptance_histogram"]]
    if hist_rows:
        width_all = max(max(r["acceptance_histogram"]) for r in hist_rows)
        bar_width = 0.8 / len(hist_rows)
        for k, r in enumerate(hist_rows):
            h = r["acceptance_histogram"]
            steps = sum(h.values()) or 1
            xs = [n + (k - (len(hist_rows) - 1) / 2) * bar_width for n in range(1, width_all + 1)]
            ax.bar(xs, [h.get(n, 0) / steps for n in range(1, width_all + 1)], width=bar_width,
                   label=f"{labels.get(r['method'], r['method'])} (tau {_fmt(r['tau'], '.2f')})")
        ax.set_xticks(range(1, width_all + 1))
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens committed per verification step")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"Acceptance lengths (T={temperatures[0]:g}, {'all datasets' if several else datasets[0]})")

    ax = axes[1]
    groups = [(d, t) for d in datasets for t in temperatures]
    bar_width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        values = []
        for d, t in groups:
            match = [r for r in rows if r["method"] == method and r["dataset"] == d and r["temperature"] == t]
            values.append(match[0]["speedup"] if match and math.isfinite(match[0]["speedup"]) else 0.0)
        xs = [i + (k - (len(methods) - 1) / 2) * bar_width for i in range(len(groups))]
        ax.bar(xs, values, width=bar_width, label=labels.get(method, method))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{d}\nT={t:g}" for d, t in groups], fontsize=8)
    ax.set_ylabel("speedup over plain generate()")
    ax.set_title("Speedup per dataset")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_report(report: Mapping[str, Any], output_dir: str | os.PathLike, name: str = "bench") -> dict[str, Path]:
    """Write `<name>.json`, `<name>.md` and (with matplotlib) `<name>.png` into `output_dir`; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(_json_safe(report), indent=1) + "\n", encoding="utf-8")
    markdown = format_markdown(report)
    png = out / f"{name}.png"
    if plot_report(report, png):
        paths["png"] = png
        markdown += f"\n![acceptance and speedup]({png.name})\n"
    paths["markdown"].write_text(markdown, encoding="utf-8")
    return paths


# ======================================================================================================================
# `dflash bench`
# ======================================================================================================================


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--dataset", action="append", default=None,
        help="mtbench, humaneval or a JSONL file of prompts (see transformers_dflash.data.load_jsonl_prompts); "
        "repeat the option for several (default: mtbench)",
    )
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset")
    parser.add_argument(
        "--prompt-selection", choices=["spread", "first"], default="spread",
        help="'spread': evenly spaced over the dataset (covers MT-Bench's categories); 'first': the first N",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy, >0 = sampling")
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS),
        help=f"comma-separated among {', '.join(DEFAULT_METHODS + OPTIONAL_METHODS)}, or 'all'",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method and prompt")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per method and temperature first")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every method)")
    parser.add_argument("--target", default=None, help="a local causal LM folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--drafter", default=None,
        help=f"a DFlash drafter folder (default: {SHIPPED_DRAFTER} if present, else an UNTRAINED drafter)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="block size (default: the drafter's; 16 untrained)")
    parser.add_argument("--drafter-layers", type=int, default=1, help="layers of an untrained drafter")
    parser.add_argument(
        "--draft-length", default="auto",
        help="dflash_adaptive: drafter.draft_length, 'auto' or a confidence threshold in [0, 1]",
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt lookup: tokens per draft")
    parser.add_argument("--early-exit-layer", type=int, default=None, help="early_exit: draft layers (default: L/4)")
    parser.add_argument("--assistant-model", default=None, help="assistant: a smaller causal LM folder, same vocab")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default=None,
                        help="weights' dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--attn-implementation", default="sdpa", help="eager, sdpa or flash_attention_2")
    parser.add_argument("--threads", type=int, default=_default_threads(), help="torch CPU threads")
    parser.add_argument("--output-dir", default="bench-results", help="where bench.json/.md/.png go")
    parser.add_argument("--name", default="bench", help="file name stem of the outputs")
    parser.add_argument("--cache-dir", default=None, help="SmolLM2 converted-copy cache (see `dflash demo --help`)")
    parser.add_argument("--no-draft-check", action="store_true", help="skip the ours-vs-built-in draft comparison")
    parser.add_argument(
        "--profile", action="store_true",
        help="also profile one greedy run of each DFlash path: time per step in draft / verify / cache / Python",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--quick", action="store_true",
        help="tiny random target + drafter and random prompts: checks the whole pipeline in seconds (numbers mean "
        "nothing)",
    )
    parser.add_argument(
        "--linear-kernels", default=None, metavar="ROWS",
        help="comma-separated row counts, e.g. 1,2,4,8,16,32,64,128: instead of decoding, time one pass over the "
        "target's nn.Linear weights with F.linear and with skinny_linear (the CPU verification kernel) at these row "
        "counts (writes <name>-linear.json/.md)",
    )
    parser.add_argument(
        "--batch-sizes", default=None,
        help="comma-separated, e.g. 1,4,8,16: instead of the per-prompt comparison, measure batched throughput (greedy) "
        "of plain generate() vs DFlash at these batch sizes (writes <name>-batch.json/.md)",
    )
    return parser


def select_prompts(prompts: Sequence[Any], n: int, how: str = "spread") -> tuple[list[int], list[Any]]:
    """`n` prompts and their indices: the first `n`, or `n` evenly spaced over the list."""
    n = max(0, min(n, len(prompts)))
    if how == "first" or n == len(prompts):
        indices = list(range(n))
    else:
        indices = [int(i * len(prompts) / n) for i in range(n)]
    return indices, [prompts[i] for i in indices]


def load_dataset_prompts(spec: str) -> tuple[str, list[str]]:
    """`(name, prompts)` for `mtbench`, `humaneval` or a JSONL path (named by its file stem)."""
    from . import data

    if spec == "mtbench":
        return "mtbench", data.load_mtbench_prompts()
    if spec == "humaneval":
        return "humaneval", data.load_humaneval_prompts()
    return Path(spec).stem, data.load_jsonl_prompts(spec)


def load_bench_drafter(target, path=None, block_size: int | None = None, num_layers: int = 1, attn: str | None = None):
    """`(drafter, description, trained)`: `path`, else the shipped SmolLM2 drafter, else an untrained one."""
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


def _quick_models(dtype, device, block_size: int | None):
    """A tiny random Llama target (its weights scaled up so that its choices look like a real model's: peaked,
    repetitive) and a 1-layer drafter; random token prompts."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from .modeling_dflash import DFlashDraftModel

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    target = target.to(device).eval()
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=block_size or 4).eval()
    g = torch.Generator().manual_seed(0)
    prompts = {"random": [torch.randint(3, 128, (1, 12 + 4 * i), generator=g) for i in range(3)]}
    return target, drafter, prompts


def run_bench(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(max(1, args.threads))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    default_dtype = "float64" if args.quick else ("bfloat16" if device.startswith("cuda") else "float32")
    dtype_name = args.dtype or default_dtype
    dtype = getattr(torch, dtype_name)
    methods = list(DEFAULT_METHODS + OPTIONAL_METHODS) if args.methods == "all" else [
        m.strip() for m in args.methods.split(",") if m.strip()
    ]
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    if args.max_new_tokens < 1 or args.num_prompts < 1 or args.repeats < 1 or args.warmup < 0 or not temperatures:
        raise SystemExit("dflash bench: need --max-new-tokens, --num-prompts, --repeats >= 1, --warmup >= 0 and a "
                         "temperature.")
    try:
        adaptive_setting = parse_draft_length(args.draft_length)
    except ValueError as error:
        raise SystemExit(f"dflash bench: --draft-length: {error}") from None
    unknown = [m for m in methods if m not in DEFAULT_METHODS + OPTIONAL_METHODS]
    if unknown:
        raise SystemExit(f"dflash bench: unknown method(s) {unknown}; choose from "
                         f"{', '.join(DEFAULT_METHODS + OPTIONAL_METHODS)} or 'all'.")

    tokenizer, assistant, prompt_indices = None, None, {}
    if args.quick:
        target, drafter, datasets = _quick_models(dtype, device, args.block_size)
        datasets = {k: v[: args.num_prompts] for k, v in datasets.items()}
        description, trained, target_name = "UNTRAINED tiny random drafter (quick mode)", False, "tiny random Llama"
    else:
        start = time.perf_counter()
        print(f"Loading the target ({dtype_name}, {device}, {torch.get_num_threads()} thread(s))...", file=sys.stderr)
        if args.target:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.target)
            target = AutoModelForCausalLM.from_pretrained(
                args.target, dtype=dtype, attn_implementation=args.attn_implementation
            ).to(device).eval()
            target_name = args.target
        else:
            from .smollm2 import SmolLM2NotAvailableError, load_smollm2

            try:
                target, tokenizer = load_smollm2(args.cache_dir, dtype=dtype, device=device)
            except SmolLM2NotAvailableError as error:
                print(f"\n{error}", file=sys.stderr)
                return 1
            target_name = "SmolLM2-135M-Instruct"
        if args.attn_implementation and getattr(target.config, "_attn_implementation", None) != args.attn_implementation:
            target.set_attn_implementation(args.attn_implementation)
        print(f"Loaded in {time.perf_counter() - start:.1f} s.", file=sys.stderr)
        drafter, description, trained = load_bench_drafter(
            target, args.drafter, args.block_size, args.drafter_layers, args.attn_implementation
        )
        if args.assistant_model:
            from transformers import AutoModelForCausalLM

            assistant = AutoModelForCausalLM.from_pretrained(args.assistant_model, dtype=dtype).to(device).eval()
        datasets = {}
        for spec in args.dataset or ["mtbench"]:
            name, prompts = load_dataset_prompts(spec)
            prompt_indices[name], datasets[name] = select_prompts(prompts, args.num_prompts, args.prompt_selection)
    if not trained:
        print(f"\nNOTE: {UNTRAINED_NOTE}\n      A trained SmolLM2 drafter is expected at {SHIPPED_DRAFTER}.\n",
              file=sys.stderr)
    if args.linear_kernels:
        return _run_linear_command(args, target, target_name, dtype_name, device)
    if args.batch_sizes:
        return _run_batch_command(args, target, drafter, tokenizer, datasets, adaptive_setting, description,
                                  target_name, dtype_name, device)
    report = run_benchmark(
        target,
        drafter,
        datasets=datasets,
        tokenizer=tokenizer,
        methods=methods,
        temperatures=temperatures,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        early_exit_layer=args.early_exit_layer,
        assistant_model=assistant,
        adaptive_draft_length=adaptive_setting,
        check_drafts=not args.no_draft_check,
        profile=args.profile,
        progress=not args.no_progress,
        drafter_description=description,
        drafter_trained=trained,
        settings={
            "target": target_name,
            "dtype": dtype_name,
            "attn_implementation": args.attn_implementation,
            "prompt_selection": args.prompt_selection,
            "prompt_indices": prompt_indices,
        },
    )
    paths = write_report(report, args.output_dir, args.name)
    print(format_markdown(report))
    print("Wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _run_linear_command(args, target, target_name, dtype_name, device) -> int:
    """`dflash bench --linear-kernels ...`: the matrix-product cost of a forward per row count, per kernel."""
    try:
        row_counts = [int(n) for n in args.linear_kernels.split(",") if n.strip()]
    except ValueError:
        row_counts = []
    if not row_counts or min(row_counts) < 1:
        raise SystemExit(f"dflash bench: --linear-kernels must be positive row counts like 1,2,4,8, got "
                         f"{args.linear_kernels!r}.")
    rows = run_linear_benchmark(target, row_counts, repeats=max(args.repeats, 5), warmup=max(args.warmup, 1))
    env = environment(device)
    header = (
        f"- command: `{env.get('command', '')}`\n- model: {target_name}; dtype {dtype_name}; {env.get('device')} "
        f"({env.get('gpu') or env.get('cpu')}), {env.get('torch_threads')} torch thread(s)\n"
        f"- torch {env.get('torch')}, transformers {env.get('transformers')}, commit "
        f"{str((env.get('git') or {}).get('commit'))[:10]}"
    )
    markdown = format_linear_markdown(rows, header)
    report = {"settings": {"row_counts": row_counts, "target": target_name, "dtype": dtype_name}, "environment": env,
              "rows": rows}
    _write_mode_report(Path(args.output_dir), f"{args.name}-linear", report, markdown)
    return 0


def _write_mode_report(out: Path, stem: str, report: dict, markdown: str) -> None:
    """`<stem>.json` and `<stem>.md` for the `--linear-kernels` / `--batch-sizes` modes; the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(_json_safe(report), indent=1) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"Wrote {out / (stem + '.json')}, {out / (stem + '.md')}", file=sys.stderr)


def _run_batch_command(args, target, drafter, tokenizer, datasets, adaptive_setting, description, target_name,
                       dtype_name, device) -> int:
    """`dflash bench --batch-sizes ...`: batched throughput over the prompts of all datasets, in order."""
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        raise SystemExit(f"dflash bench: --batch-sizes must be positive integers like 1,4,8,16, got {args.batch_sizes!r}.")
    requested = BATCH_METHODS if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    batch_methods = [m for m in requested if m in BATCH_METHODS and m != "baseline"]
    if not batch_methods:
        raise SystemExit(f"dflash bench --batch-sizes: --methods must name at least one of {BATCH_METHODS[1:]}.")
    prompts = [encode_prompt(tokenizer, p, device)[0] for ps in datasets.values() for p in ps]
    pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    rows = run_batch_benchmark(
        target, drafter, prompts, batch_sizes=batch_sizes, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
        warmup=args.warmup, pad_token_id=pad_token_id,
        adaptive_draft_length=adaptive_setting, progress=not args.no_progress, methods=batch_methods,
    )
    env = environment(device)
    header = (
        f"- command: `{env.get('command', '')}`\n- target: {target_name}; drafter: {description}; dtype {dtype_name}; "
        f"{env.get('device')} ({env.get('gpu') or env.get('cpu')}), {env.get('torch_threads')} torch thread(s)\n"
        f"- prompts: {', '.join(f'{k} ({len(v)})' for k, v in datasets.items())}, cycled to fill each batch; "
        f"max new tokens {args.max_new_tokens}; repeats {args.repeats}; warm-up {args.warmup}\n"
        f"- torch {env.get('torch')}, transformers {env.get('transformers')}, commit "
        f"{str((env.get('git') or {}).get('commit'))[:10]}"
    )
    markdown = format_batch_markdown(rows, header)
    report = {"settings": {"batch_sizes": batch_sizes, "max_new_tokens": args.max_new_tokens, "target": target_name,
                           "drafter": description, "dtype": dtype_name}, "environment": env, "rows": rows}
    _write_mode_report(Path(args.output_dir), f"{args.name}-batch", report, markdown)
    return 0
