"""Batched throughput: many prompts per `generate()` call, plain batched decoding against batched DFlash."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime import synchronize
from .methods import BATCH_METHODS, METHOD_LABELS, PLAIN_METHODS, build_methods
from .metrics import acceptance_steps, speedup, tokens_per_second
from .progress import progress_bar
from .report import fmt, table_section


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
    if methods is None:
        methods = ["dflash"] + (["dflash_adaptive"] if adaptive_draft_length is not None else [])
    unknown = sorted(set(methods) - set(BATCH_METHODS))
    if unknown:
        raise ValueError(f"batched benchmark methods {unknown} are not among {BATCH_METHODS}")
    if adaptive_draft_length is None and {"dflash_adaptive", "dflash_lookup"} & set(methods):
        adaptive_draft_length = "auto"
    # The same registry entries as the single-stream benchmark: they take batched ids and masks alike.
    method_list, _ = build_methods(
        target, drafter, list(dict.fromkeys(["baseline", *methods])), adaptive_draft_length=adaptive_draft_length
    )
    bar = progress_bar(progress, len(batch_sizes) * len(method_list) * (warmup + repeats))
    rows: list[dict] = []
    try:
        for batch_size in batch_sizes:
            chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
            input_ids, attention_mask = left_pad(chosen, pad_token_id, device)
            kwargs = dict(
                attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id
            )
            totals = {m.name: {"tokens": 0, "seconds": 0.0, "steps": [], "equal": True} for m in method_list}
            reference = None

            def call(method):
                synchronize(device)
                start = time.perf_counter()
                with torch.inference_mode():
                    out, acceptance = method.generate(input_ids, kwargs)
                synchronize(device)
                return out[:, input_ids.shape[1] :], acceptance, time.perf_counter() - start

            for method in method_list:
                for _ in range(warmup):
                    bar.set_postfix_str(f"warm-up batch {batch_size} {method.name}")
                    new, _, _ = call(method)
                    reference = new if method.name == "baseline" else reference
                    bar.update()
            for repeat in range(repeats):
                order = method_list[repeat % len(method_list) :] + method_list[: repeat % len(method_list)]
                for method in order:
                    name = method.name
                    bar.set_postfix_str(f"batch {batch_size} {name}")
                    new, acceptance, seconds = call(method)
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
                        total["steps"].append(batch_acceptance_length(acceptance))
                    bar.update()
            base_rate = tokens_per_second(totals["baseline"]["tokens"], totals["baseline"]["seconds"])
            for name in totals:
                total = totals[name]
                rate = tokens_per_second(total["tokens"], total["seconds"])
                taus = [t for t in total["steps"] if math.isfinite(t)]
                rows.append(
                    {
                        "batch_size": batch_size,
                        "method": name,
                        "tokens_per_s": rate,
                        "speedup": speedup(rate, base_rate),
                        "tau": sum(taus) / len(taus) if taus else (1.0 if name in PLAIN_METHODS else float("nan")),
                        "tokens": total["tokens"],
                        "seconds": total["seconds"],
                        "rows_equal": total["equal"],
                    }
                )
    finally:
        bar.close()
    return rows


def format_batch_markdown(rows: Sequence[Mapping[str, Any]], header: str = "") -> str:
    """The batched-throughput table."""
    body = [
        f"| {r['batch_size']} | {METHOD_LABELS.get(r['method'], r['method'])} | "
        f"{fmt(r['tokens_per_s'], '.1f')} | {fmt(r['speedup'], '.2f')}x | "
        f"{fmt(r['tau'], '.2f')} | {r['tokens']} | {r['seconds']:.1f} | {'yes' if r['rows_equal'] else 'NO'} |"
        for r in rows
    ]
    return table_section(
        "DFlash batched throughput (greedy)",
        header,
        "| batch size | method | tokens/s (whole batch) | speedup | tau | generated tokens | seconds | rows equal plain |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
        body,
        "tokens/s: tokens generated by all rows (each up to its first EOS) over wall time; speedup over plain batched "
        "generate() at the same batch size; tau: tokens committed per row and verification step.",
    )
