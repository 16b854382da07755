"""A/B of how `skinny_linear` measures its kernel choice, at the drafter's defaults (docs/benchmarks.md, "Kernel
choice with the weights out of cache").

- "cached": each timed run of a kernel reads the same weight, which the run before left in the CPU's caches (the
  measurement before this change);
- "cold" (the core): each run reads another copy of the weight, so that it comes from memory as in a forward.

Each variant keeps its own kernel choices (measured on its first use of a weight shape and row count, as a new process
does) and its own `drafter.draft_length_memory`. The cached choice changed from process to process, so run this script
several times. Each round runs plain `generate()` and both variants on every prompt (the demo's, MT-Bench,
HumanEval) in a shuffled order; every output is checked against plain `generate()`'s.

    python scripts/ab_kernel_choice.py --threads 2 --rounds 2 [--num-prompts 3] [--max-new-tokens 128]
"""

import argparse
import contextlib
import itertools
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import load_prompts, load_smollm2_pair, print_report, time_rounds  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    args = parser.parse_args()

    import torch

    from transformers_dflash import kernels

    core_cold_weights = kernels.cold_weights

    def rules(cold_weights):
        choices, memory = {}, {}  # the variant's own, kept from call to call

        @contextlib.contextmanager
        def variant_rules():
            saved = kernels._transposed_is_faster
            kernels._transposed_is_faster, kernels.cold_weights = choices, cold_weights
            drafter.draft_length_memory = memory
            try:
                yield
            finally:
                kernels._transposed_is_faster, kernels.cold_weights = saved, core_cold_weights

        return variant_rules

    variants = {"cached": rules(lambda weight: itertools.repeat(weight)), "cold": rules(core_cold_weights)}
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    prompts = load_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    timings = time_rounds(target, drafter, prompts, kwargs, variants, args.rounds, seed=args.threads)
    print_report(timings, args.threads, baseline="cached")


if __name__ == "__main__":
    main()
