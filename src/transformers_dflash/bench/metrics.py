"""Report arithmetic: small pure functions on plain numbers (tokens/s, speedups, tau, histograms), one timed run
(`Sample`) and the summary rows built from many (`summarize`), testable on hand-made numbers."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field


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
    modelled_seconds: float | None = None  # the steps' cost under fixed step costs (None: not modelled)

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


def _rate(runs: Sequence[Sample]) -> float:
    """Total new tokens over total seconds of `runs` (NaN for none)."""
    return tokens_per_second(sum(s.new_tokens for s in runs), sum(s.seconds for s in runs))


def _modelled_rate(runs: Sequence[Sample]) -> float:
    """Total new tokens over total modelled seconds (fixed step costs) of `runs`; NaN unless every run has them."""
    if not runs or any(s.modelled_seconds is None for s in runs):
        return math.nan
    return tokens_per_second(sum(s.new_tokens for s in runs), sum(s.modelled_seconds for s in runs))


def median_and_range(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values (NaNs when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return statistics.median(finite), min(finite), max(finite)


def summarize(
    samples: Sequence[Sample],
    baseline: str = "baseline",
    max_length: int | None = None,
    mismatches: Sequence[dict] | None = None,
) -> list[dict]:
    """One row per (temperature, dataset, method), plus dataset "all" rows when there are several datasets.

    Rates are totals over the runs (total new tokens / total seconds), so long answers weigh more, as in a serving
    log. speedup is relative to the baseline row of the same temperature and dataset; tau, its histogram and r pool
    the verification steps of all runs (baseline: tau = 1 by definition). speedup_per_repeat has the same ratio per
    repeat index (repeat k of every prompt against the baseline's repeat k, which ran beside it), so that its median
    and range show how far machine noise moves the pooled figure. With fixed step costs, modelled_tokens_per_s and
    modelled_speedup are the same figures with every run's modelled seconds for its wall time (NaN without them).
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
                s
                for s in samples
                if s.temperature == temperature and s.method == method and dataset in ("all", s.dataset)
            ]

        base = pick(baseline)
        base_rate, base_modelled = _rate(base), _modelled_rate(base)
        base_rates = {k: _rate([s for s in base if s.repeat == k]) for k in sorted({s.repeat for s in base})}
        for method in methods:
            runs = pick(method)
            if not runs:
                continue
            tokens, seconds = sum(s.new_tokens for s in runs), sum(s.seconds for s in runs)
            rate, modelled = tokens_per_second(tokens, seconds), _modelled_rate(runs)
            gain = speedup(rate, base_rate)
            per_repeat = [
                speedup(_rate([s for s in runs if s.repeat == k]), rate_k) for k, rate_k in base_rates.items()
            ]
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
                    "speedup_per_repeat": per_repeat,
                    "modelled_tokens_per_s": modelled,
                    "modelled_speedup": speedup(modelled, base_modelled),
                    "tau": tau,
                    "acceptance_histogram": histogram,
                    "r": overhead_ratio(tau, gain),
                    "mismatches": sum(
                        1
                        for m in mismatches
                        if temperature == 0 and m["method"] == method and dataset in ("all", m["dataset"])
                    ),
                }
            )
    return rows


def relative_rate(rows: Sequence[dict], method: str, other: str) -> list[dict]:
    """`method`'s token rate over `other`'s, per (temperature, dataset) where both ran (e.g. ours vs built-in), pooled
    and per repeat."""
    index = {(r["temperature"], r["dataset"], r["method"]): r for r in rows}
    out = []
    for (temperature, dataset, name), row in index.items():
        if name != method or (temperature, dataset, other) not in index:
            continue
        other_row = index[(temperature, dataset, other)]
        # both speedups of repeat k share the baseline's k-th runs, so their ratio is the paired rate ratio
        paired = zip(row.get("speedup_per_repeat") or [], other_row.get("speedup_per_repeat") or [])
        out.append(
            {
                "temperature": temperature,
                "dataset": dataset,
                "ratio": speedup(row["tokens_per_s"], other_row["tokens_per_s"]),
                "ratio_per_repeat": [speedup(a, b) for a, b in paired],
                "modelled_ratio": speedup(
                    row.get("modelled_tokens_per_s", math.nan), other_row.get("modelled_tokens_per_s", math.nan)
                ),
                "tau": row["tau"],
                "other_tau": other_row["tau"],
            }
        )
    return out
