"""A/B of how `skinny_linear` chooses its kernels, at the drafter's defaults (docs/benchmarks.md, "Kernel choice with
the weights out of cache", "oneDNN's packed weights").

- "cached": each timed run of a kernel reads the same weight, which the run before left in the CPU's caches (the
  measurement before the cold copies);
- "unpacked": the weights out of cache, choosing between `F.linear` and the transposed product only (the kernels
  before the packed product);
- "any-saving": the cold choice, taking another product wherever it is faster by the margin, however little it
  saves (before `_MIN_SAVING_SECONDS`);
- "cold" (the core): the weights out of cache, and the packed product among the candidates where oneDNN has it;
- "packed-at-par": as "cold", but the packed product needs only the margin the transposed one needs (no
  `_PACKED_MARGIN` for the copy of the weight it keeps);
- "all-packed": the packed product for every few-row product, measured or not.

Each variant keeps its own kernel choices (measured on its first use of a weight shape and row count, as a new process
does) and its own `drafter.draft_length_memory`. A choice can change from process to process, so run this script
several times. Each round runs plain `generate()` and every variant on every prompt (the demo's, MT-Bench,
HumanEval) in a shuffled order; every output is checked against plain `generate()`'s.

    python scripts/ab_kernel_choice.py --threads 2 --rounds 2 [--variants cached,unpacked,cold] [--num-prompts 3]
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Each variant measures its own kernel choices, as a new process would: none read from, or written to, the file that
# keeps a machine's choices between processes (kernel_choices.py).
os.environ["DFLASH_KERNEL_CACHE"] = "off"

from interleaved_ab import load_prompts, load_smollm2_pair, print_report, time_rounds  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--variants",
        default="cached,unpacked,cold",
        help="comma-separated: cached, unpacked, any-saving, cold, packed-at-par, all-packed",
    )
    parser.add_argument("--draft-length", default=None, help='the drafter\'s draft_length (default: its own, "auto")')
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    args = parser.parse_args()

    import torch

    from transformers_dflash import kernels

    class CachedCopies(kernels.ColdCopies):
        @property
        def copies(self):
            return [self.weight]

    core = {
        "ColdCopies": kernels.ColdCopies,
        "packing_available": kernels.packing_available,
        "_MIN_SAVING_SECONDS": kernels._MIN_SAVING_SECONDS,
        "_PACKED_MARGIN": kernels._PACKED_MARGIN,
        "kernel_for": kernels.kernel_for,
    }
    patches = {
        "cached": {"ColdCopies": CachedCopies},
        "unpacked": {"packing_available": lambda: False},
        "any-saving": {"_MIN_SAVING_SECONDS": 0.0},
        "cold": {},
        "packed-at-par": {"_PACKED_MARGIN": 1.0},
        "all-packed": {
            "kernel_for": lambda weight, rows, input=None, cold=None: (
                "packed" if rows <= kernels._MAX_ROWS else "linear"
            )
        },
    }

    def rules(variant):
        choices, memory = {}, {}  # the variant's own, kept from call to call

        @contextlib.contextmanager
        def variant_rules():
            saved = kernels._kernel_choice
            kernels._kernel_choice = choices
            for name, value in {**core, **patches[variant]}.items():
                setattr(kernels, name, value)
            drafter.draft_length_memory = memory
            try:
                yield
            finally:
                kernels._kernel_choice = saved
                for name, value in core.items():
                    setattr(kernels, name, value)

        return variant_rules

    variants = {variant: rules(variant) for variant in args.variants.split(",")}
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    if args.draft_length is not None:
        drafter.draft_length = args.draft_length if args.draft_length in ("auto", "full") else float(args.draft_length)
    prompts = load_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    timings = time_rounds(target, drafter, prompts, kwargs, variants, args.rounds, seed=args.threads)
    print_report(timings, args.threads, baseline=next(iter(variants)))


if __name__ == "__main__":
    main()
