"""The linear kernels alone: one pass over a model's `nn.Linear` weights per row count, `F.linear` against
`kernels.transposed_linear` (the product `kernels.skinny_linear` takes where it measured faster)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..runtime import synchronize
from .report import fmt, table_section


def run_linear_benchmark(
    model, row_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 5, warmup: int = 1
) -> list[dict]:
    """Time one pass over every `nn.Linear` weight of `model` (a forward's matrix products, in order) with
    `F.linear` and with `kernels.transposed_linear`, for inputs of each row count.

    The two kernels alternate pass by pass, so machine noise hits both alike. The weights are read from memory as in a
    real forward (a model's weights do not fit in the CPU caches). Returns one row per row count: milliseconds per
    pass for each kernel, their ratio, and each kernel's cost relative to `F.linear` on one row.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    from ..kernels import transposed_linear

    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to time.")
    device = weights[0][0].device
    rows = []
    with torch.inference_mode():
        inputs = {
            (n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype, device=device)
            for n in row_counts
            for w, _ in weights
        }

        def one_pass(kernel, n):
            synchronize(device)
            start = time.perf_counter()
            for weight, bias in weights:
                kernel(inputs[n, weight.shape[1]], weight, bias)
            synchronize(device)
            return time.perf_counter() - start

        for n in row_counts:
            for _ in range(warmup):
                one_pass(F.linear, n), one_pass(transposed_linear, n)
            stock = skinny = 0.0
            for _ in range(repeats):
                stock += one_pass(F.linear, n)
                skinny += one_pass(transposed_linear, n)
            rows.append({"rows": n, "linear_ms": stock / repeats * 1e3, "skinny_ms": skinny / repeats * 1e3})
    one_row = rows[0]["linear_ms"] if rows and rows[0]["rows"] == 1 else math.nan
    for row in rows:
        row["skinny_over_linear"] = row["skinny_ms"] / row["linear_ms"]
        row["linear_vs_one_row"] = row["linear_ms"] / one_row
        row["skinny_vs_one_row"] = row["skinny_ms"] / one_row
    return rows


def format_linear_markdown(rows: Sequence[Mapping[str, Any]], header: str = "") -> str:
    """The linear-kernel table."""
    body = [
        f"| {r['rows']} | {r['linear_ms']:.1f} | {r['skinny_ms']:.1f} | {fmt(r['skinny_over_linear'], '.2f')} | "
        f"{fmt(r['linear_vs_one_row'], '.2f')}x | {fmt(r['skinny_vs_one_row'], '.2f')}x |"
        for r in rows
    ]
    return table_section(
        "Linear kernels: one pass over the model's nn.Linear weights",
        header,
        "| rows | F.linear (ms) | transposed (ms) | transposed / F.linear | F.linear vs 1 row | transposed vs 1-row "
        "F.linear |",
        "|---:|---:|---:|---:|---:|---:|",
        body,
        "rows: tokens x batch rows of a forward (a verification step of width w at batch b has w*b rows). transposed: "
        "`kernels.transposed_linear`, one row as two copies of itself. DFlash decoding's `skinny_linear` takes it "
        "for a weight shape and row count only where it measured clearly faster on this machine, else F.linear.",
    )
