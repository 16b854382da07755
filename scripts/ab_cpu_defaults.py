"""A/B of the drafter's CPU defaults against the rules they replaced, in one process (docs/benchmarks.md, "Kernels
measured per machine, and a realised-rate guard").

Variants, each the shipped drafter at its defaults (`draft_length="auto"`, 2-gram copies) but for:
- `static`: the kernel rule before (fixed by row count and thread count, as measured on an AMD EPYC), and "auto"
  judging drafting by its drafts' confidences alone;
- `measured`: `skinny_linear`'s kernel choice measured on this machine, confidences alone;
- `realised`: measured kernels, and "auto" also stops drafting when the drafted steps realise fewer tokens per
  second than plain steps;
- `defaults`: what the package does now: the above, and each generate() call starts from the step costs and copy
  rates measured in the drafter's earlier calls (`drafter.draft_length_memory`); the variants before start every
  call afresh.
Each round runs plain `generate()` and every variant on every prompt, in a shuffled order per prompt; every output is
checked against plain `generate()`'s. Each variant keeps its own table of kernel choices for the whole run, and
`defaults` its own memory.

    python scripts/ab_cpu_defaults.py [--threads 2] [--rounds 3] [--max-new-tokens 256] [--num-prompts 2]

Prints plain tokens/s and, per variant, its speedup over plain decoding (total seconds over all prompts, per round:
median and range), tau, the median per prompt, and each variant over `static` per round.
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

from interleaved_ab import load_prompts, print_report, time_rounds  # noqa: E402  (beside this script)

VARIANTS = ("static", "measured", "realised", "defaults")


def static_rule(flat, weight, cold=None) -> str:
    """The kernel rule before measured choices (commit 0a90bdc): fixed by row count and thread count."""
    import torch

    rows, tall = flat.shape[0], weight.shape[0] >= 8 * weight.shape[1]
    if torch.get_num_threads() == 1:
        transposed = 2 <= rows <= (8 if tall else 4)
    else:
        transposed = (1 if tall else 2) <= rows <= 256
    return "transposed" if transposed else "linear"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=2, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated among {', '.join(VARIANTS)}")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    args = parser.parse_args()
    variants = args.variants.split(",")

    import torch
    from transformers import AutoModel

    import transformers_dflash as td
    from transformers_dflash import kernels
    from transformers_dflash.draft_length import AutoDraftLength

    measure, record = kernels._measure, AutoDraftLength.record
    tables = {variant: {} for variant in variants}
    memory = {}  # the `defaults` variant's

    def rules(variant):
        @contextlib.contextmanager
        def variant_rules():
            kernels._kernel_choice = tables[variant]
            kernels._measure = static_rule if variant == "static" else measure
            if variant in ("static", "measured"):  # confidences alone: the realised rate never gets a sample
                AutoDraftLength.record = lambda self, w, s, d=None, accepted=None: record(self, w, s, d)
            drafter.draft_length_memory = memory if variant == "defaults" else {}
            try:
                yield
            finally:
                kernels._measure, AutoDraftLength.record = measure, record

        return variant_rules

    torch.set_num_threads(args.threads)
    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(args.drafter or td.SHIPPED_DRAFTER, dtype=target.dtype)
    prompts = load_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    # Round 0 warms up, and measures each variant's kernels.
    timings = time_rounds(target, drafter, prompts, kwargs, {v: rules(v) for v in variants}, args.rounds)
    print_report(timings, args.threads, baseline="static" if "static" in variants else None)


if __name__ == "__main__":
    main()
