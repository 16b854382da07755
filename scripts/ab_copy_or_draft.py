"""A/B of who heads a block when a copy is found: the drafter's drafts where it expects more of them accepted (the
core, "better-expected") against the copy always ("copy-first", as before), at the drafter's defaults
(docs/training.md, "Copies no longer hide the drafter").

Each round runs plain `generate()` and both variants on every prompt (the demo's, MT-Bench, HumanEval) in a shuffled
order per prompt; every output is checked against plain `generate()`'s. Each call starts with an empty memory, so
neither variant inherits the other's copy rates.

    python scripts/ab_copy_or_draft.py --threads 2 --rounds 3 [--max-new-tokens 256] [--drafter PATH]

Prints, per thread count: each variant's speedup over plain decoding (total seconds over all prompts, per round:
median and range), its tau, its median speedup per prompt, and better-expected over copy-first per round.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import add_comparison_arguments, compare_per_thread_count, load_smollm2_pair  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_comparison_arguments(parser, threads=[2], rounds=3, max_new_tokens=256)
    args = parser.parse_args()

    from transformers_dflash.ngram_lookup import NgramLookup

    better_expected = NgramLookup._keeps_drafts

    def rules(keeps_drafts):
        @contextlib.contextmanager
        def variant_rules():
            NgramLookup._keeps_drafts = staticmethod(keeps_drafts)
            drafter.draft_length_memory = {}
            try:
                yield
            finally:
                NgramLookup._keeps_drafts = staticmethod(better_expected)

        return variant_rules

    variants = {
        "copy-first": rules(lambda copy_expected, draft_expected: False),
        "better-expected": rules(better_expected),
    }
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    compare_per_thread_count(target, tokenizer, drafter, variants, args, "copy-first", "better-expected")


if __name__ == "__main__":
    main()
