"""A/B of copied drafts' acceptance rates kept per match length against one table for all, at the drafter's defaults
(docs/benchmarks.md, "Copies by match length").

With `draft_length="auto"` a copied draft's confidence is the rate at which copies at its depth were accepted in this
call. The core ("by-length") keeps one such table per match length (copies after a 2-gram match, after a 1-gram
match); "shared" gives every match length the same table, as before. Each round runs plain `generate()`, "shared"
and "by-length" on every prompt in a shuffled order per prompt; every output is checked against plain `generate()`'s.

    python scripts/ab_copy_rates.py --threads 1 2 --rounds 3 [--max-new-tokens 128] [--drafter PATH]

Prints, per thread count: each variant's speedup over plain decoding (total seconds over all prompts, per round:
median and range), its tau, its median speedup per prompt, and by-length / shared per round.
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
    add_comparison_arguments(parser, threads=[1, 2], rounds=3, max_new_tokens=128)
    args = parser.parse_args()

    from transformers_dflash import candidate_generator
    from transformers_dflash.ngram_lookup import CopyAcceptance, ngram_lookup_for

    def shared_lookup(setting, block_size, device):
        lookup = ngram_lookup_for(setting, block_size, device)
        if lookup is not None:
            table = CopyAcceptance(block_size)
            lookup.acceptance = dict.fromkeys(lookup.acceptance, table)
        return lookup

    def rules(factory):
        @contextlib.contextmanager
        def variant_rules():
            candidate_generator.ngram_lookup_for = factory
            drafter.draft_length_memory = {}  # each call afresh, so that neither variant inherits the other's rates
            try:
                yield
            finally:
                candidate_generator.ngram_lookup_for = ngram_lookup_for

        return variant_rules

    variants = {"shared": rules(shared_lookup), "by-length": rules(ngram_lookup_for)}
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    compare_per_thread_count(target, tokenizer, drafter, variants, args, "shared", "by-length")


if __name__ == "__main__":
    main()
