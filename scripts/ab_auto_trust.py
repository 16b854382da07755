"""A/B of `draft_length="auto"`'s trust rules at the drafter's defaults, in one process (docs/benchmarks.md).

"auto" learns each width's step cost and each copy depth's acceptance within a call. The core's rules ("new"): a
width measured fewer than `TRUSTED` times costs at most what the line through all steps says, a copy depth tried fewer
than `TRUSTED` times is rated no lower than the depth before, and a depth whose copy is proposed but not verified
keeps `FORGET` of its counts. The rules before ("old"): `TRUSTED = 0`, `FORGET = 1`, every measurement stands for the
whole call. Each round times plain `generate()`, the old rule and the new one on every prompt, in a shuffled order per
prompt (`interleaved_ab.time_rounds`); every output is checked against plain `generate()`'s.

    python scripts/ab_auto_trust.py --rounds 3 [--drafter PATH]

Prints each rule's speedup over plain decoding (total seconds over all prompts, per round: median and range), its
tau, its median speedup per prompt, and new / old per round.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import load_prompts, print_report, time_rounds  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    import transformers_dflash as td
    from transformers_dflash.draft_length import AutoDraftLength
    from transformers_dflash.ngram_lookup import CopyAcceptance

    def rules(trusted: int, forget: float):
        @contextlib.contextmanager
        def variant_rules():
            saved = AutoDraftLength.TRUSTED, CopyAcceptance.TRUSTED, CopyAcceptance.FORGET
            AutoDraftLength.TRUSTED = CopyAcceptance.TRUSTED = trusted
            CopyAcceptance.FORGET = forget
            drafter.draft_length_memory.clear()  # every call afresh: neither rule inherits the other's figures
            try:
                yield
            finally:
                AutoDraftLength.TRUSTED, CopyAcceptance.TRUSTED, CopyAcceptance.FORGET = saved

        return variant_rules

    torch.set_num_threads(args.threads)
    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(args.drafter or td.SHIPPED_DRAFTER, dtype=target.dtype)
    prompts = load_prompts(tokenizer, args.num_prompts, demo=False)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    variants = {"old": rules(0, 1.0), "new": rules(AutoDraftLength.TRUSTED, CopyAcceptance.FORGET)}
    timings = time_rounds(target, drafter, prompts, kwargs, variants, args.rounds)
    print_report(timings, args.threads, baseline="old")


if __name__ == "__main__":
    main()
