"""`F.linear` against `kernels.transposed_linear` (the product `skinny_linear` takes where it measures faster) per
weight shape and row count, on this CPU (docs/benchmarks.md, "Linear kernels by shape"). Not a test: prints median [min-max] of the ratio over repeats that interleave the two kernels.

    PYTHONPATH=src python scripts/bench_linear_shapes.py [--threads 2] [--repeats 7]

Each shape cycles through enough copies of its weight to exceed the CPU caches (as a forward reads its weights from
memory). Shapes: square and rectangular projections of small models and an LM head (SmolLM2's 49152 x 576).
"""

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from transformers_dflash.kernels import transposed_linear

SHAPES = [(256, 256), (768, 256), (256, 768), (576, 576), (1536, 576), (576, 1536), (1024, 1024), (2048, 1024),
          (4096, 256), (49152, 576)]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); microseconds per product, median over {args.repeats}")
    print("| weight (out x in) | rows | F.linear | transposed | transposed / F.linear, median [min-max] |")
    print("|---|---:|---:|---:|---:|")
    for out_features, in_features in SHAPES:
        weights = [torch.randn(out_features, in_features) for _ in range(max(1, 2**24 // (out_features * in_features)))]
        for rows in args.rows:
            x = torch.randn(rows, in_features)

            def run(kernel):
                start = time.perf_counter()
                for weight in weights:
                    kernel(x, weight)
                return (time.perf_counter() - start) / len(weights) * 1e6

            run(F.linear), run(transposed_linear)  # warm-up
            stock, skinny = [], []
            for _ in range(args.repeats):
                stock.append(run(F.linear))
                skinny.append(run(transposed_linear))
            ratios = [s / f for f, s in zip(stock, skinny)]
            print(
                f"| {out_features} x {in_features} | {rows} | {statistics.median(stock):.1f} | "
                f"{statistics.median(skinny):.1f} | {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
            )


if __name__ == "__main__":
    main()
