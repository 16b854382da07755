"""Benchmarks: DFlash side by side with plain decoding, transformers' own DFlash path and prompt lookup.

    dflash bench --dataset mtbench --num-prompts 5 --max-new-tokens 64 --threads 1
    dflash bench --dataset mtbench --dataset humaneval --dataset my_prompts.jsonl --temperatures 0
    dflash bench --quick                     # tiny random models, seconds: a smoke test of the whole pipeline

In ONE process, on the same prompts and the same target, it times (methods interleaved per prompt, after warm-up runs,
so that machine noise hits all of them alike) the methods of `methods.REGISTRY`:

- `baseline`: plain `target.generate()`;
- `dflash`: this package, `target.generate(assistant_model=drafter)`, verifying the whole block every step;
- `dflash_adaptive`: the same with `drafter.draft_length` (default `"auto"`): only the drafts worth their
  verification cost are verified (lossless; see the README);
- `builtin_dflash`: transformers' own `speculation_type="dflash"` path (transformers >= 5 with
  `models/muse_glimmer_assistant`), fed the SAME drafter weights, converted by `to_builtin_drafter`;
- `prompt_lookup`: prompt lookup decoding (`prompt_lookup_num_tokens`), the drafter-free alternative;
- optional: `dflash_lookup` (DFlash with copied drafts), `early_exit` (self-speculation with the target's first
  layers, `assistant_early_exit`), `assistant` (classic speculative decoding with a small model of the same
  vocabulary, `--assistant-model`) and the kernel attributions `baseline_skinny`, `prompt_lookup_skinny`,
  `dflash_stock_linears`.

Reports per method (and dataset, temperature): tokens/s, time per output token, speedup over the baseline, the mean
acceptance length tau (tokens committed per target forward after the prefill; 1.0 for the baseline) with its
histogram, and r = tau / speedup (the implied per-step overhead: 1.0 is ideal). Greedy runs check that every method's
output equals the baseline's and flag any mismatch. Writes JSON (with the environment), Markdown and a PNG plot.

One module per concern, each depending only on those before it:
`metrics` (report arithmetic on plain numbers), `drafter` (run-time settings), `fixed_costs` (step costs held
fixed, `--fixed-step-costs`: drafters compared by their drafts alone), `assisted` (what transformers' loop accepted), `builtin` (the built-in path with our weights), `methods` (the registry), `profile` (where a step's time
goes), `report` (environment, Markdown, plot, files), `single_stream` (`run_benchmark`), `batched`
(`run_batch_benchmark`), `kernels` (`run_linear_benchmark`), `prompts`. The command line is `transformers_dflash.cli
.bench`; nothing here imports it. Measured figures: docs/benchmarks.md.
"""

from .assisted import AssistedRecorder
from .batched import batch_acceptance_length, format_batch_markdown, generated_lengths, left_pad, run_batch_benchmark
from .builtin import (
    BUILTIN_DRAFTER_RENAMES,
    builtin_dflash_available,
    builtin_state_dict,
    compare_drafts,
    to_builtin_drafter,
)
from .drafter import core_module, draft_length, drafter_setting, fast_cpu_linears, ngram_lookup, parse_draft_length
from .kernels import format_linear_markdown, run_linear_benchmark
from .methods import (
    BATCH_METHODS,
    DEFAULT_METHODS,
    METHOD_LABELS,
    OPTIONAL_METHODS,
    PLAIN_METHODS,
    REGISTRY,
    Method,
    MethodSpec,
    build_methods,
)
from .metrics import (
    Sample,
    acceptance_histogram,
    acceptance_steps,
    find_mismatches,
    first_difference,
    mean_acceptance_length,
    median_and_range,
    overhead_ratio,
    relative_rate,
    speedup,
    summarize,
    time_per_output_token_ms,
    tokens_per_second,
)
from .profile import StepProfiler, profile_step
from .prompts import load_dataset_prompts, select_prompts
from .report import environment, format_markdown, plot_report, write_report
from .single_stream import UNTRAINED_NOTE, encode_prompt, run_benchmark

__all__ = [
    "BATCH_METHODS",
    "BUILTIN_DRAFTER_RENAMES",
    "DEFAULT_METHODS",
    "METHOD_LABELS",
    "OPTIONAL_METHODS",
    "PLAIN_METHODS",
    "REGISTRY",
    "UNTRAINED_NOTE",
    "AssistedRecorder",
    "Method",
    "MethodSpec",
    "Sample",
    "StepCosts",
    "FixedCostDraftLength",
    "measure_step_costs",
    "StepProfiler",
    "acceptance_histogram",
    "acceptance_steps",
    "batch_acceptance_length",
    "build_methods",
    "builtin_dflash_available",
    "builtin_state_dict",
    "compare_drafts",
    "core_module",
    "draft_length",
    "drafter_setting",
    "encode_prompt",
    "environment",
    "fast_cpu_linears",
    "find_mismatches",
    "first_difference",
    "format_batch_markdown",
    "format_linear_markdown",
    "format_markdown",
    "generated_lengths",
    "left_pad",
    "load_dataset_prompts",
    "mean_acceptance_length",
    "median_and_range",
    "ngram_lookup",
    "overhead_ratio",
    "parse_draft_length",
    "plot_report",
    "profile_step",
    "relative_rate",
    "run_batch_benchmark",
    "run_benchmark",
    "run_linear_benchmark",
    "select_prompts",
    "speedup",
    "summarize",
    "time_per_output_token_ms",
    "to_builtin_drafter",
    "tokens_per_second",
    "write_report",
]


def __getattr__(name):
    """`StepCosts`, `FixedCostDraftLength`, `measure_step_costs` on first use: `fixed_costs` imports torch, which
    `dflash bench --help` must not."""
    if name in ("StepCosts", "FixedCostDraftLength", "measure_step_costs"):
        from . import fixed_costs

        return getattr(fixed_costs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
