"""A/B of the longest n-gram that copied drafts are found by (`drafter.ngram_lookup`), at the drafter's other defaults
(docs/benchmarks.md, "Copies by match length").

A longer match finds fewer copies, but they are accepted more often, and `"auto"` keeps one acceptance table per match
length, so it verifies the copies of each length as far as they pay. Each round runs plain `generate()` and every size
on every prompt (the demo's, MT-Bench, HumanEval) in a shuffled order per prompt; every output is checked against plain
`generate()`'s. The drafter's memory is kept across calls, as a user's is (it is kept per size: each size learns its
own copy rates in the warm-up round).

    python scripts/ab_ngram_size.py --sizes 2 6 --threads 2 --rounds 5 [--max-new-tokens 256] [--drafter PATH]

Prints, per thread count: each size's speedup over plain decoding (total seconds over all prompts, per round: median
and range), its tau, its median speedup per prompt, and the last size over the first per round.
"""

import argparse
import functools
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import add_comparison_arguments, compare_per_thread_count, load_smollm2_pair  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 6], help="`drafter.ngram_lookup` values")
    add_comparison_arguments(parser, threads=[2], rounds=5, max_new_tokens=256)
    args = parser.parse_args()
    if len(args.sizes) < 2 or min(args.sizes) < 1:
        parser.error("--sizes needs two or more n-gram sizes of at least 1, e.g. --sizes 2 6")

    from transformers_dflash.bench.drafter import ngram_lookup

    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    variants = {f"n={size}": functools.partial(ngram_lookup, drafter, size) for size in args.sizes}
    compare_per_thread_count(target, tokenizer, drafter, variants, args, f"n={args.sizes[0]}", f"n={args.sizes[-1]}")


if __name__ == "__main__":
    main()
