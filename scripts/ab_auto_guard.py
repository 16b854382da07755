"""A/B of when `draft_length="auto"` runs the drafter at all, at the drafter's defaults (docs/benchmarks.md).

Three variants, each the one before plus one rule:
- "before": the drafted steps' realised rate counts each step at its own measured times, and a width costs the mean
  of its steps;
- "estimated": the realised rate counts each step at its estimated cost (the mean draft and the median step of its
  width), so that one step slowed by something else on the machine does not stop the drafter;
- "defaults" (the core): also skip the drafter where this step's copies are expected to do better than its drafts
  usually do (`AutoDraftLength.draft_beats_copies`).

Each variant keeps its own `drafter.draft_length_memory` from call to call, as a user's drafter does. Each round
runs plain `generate()` and the variants on every prompt (the demo's, MT-Bench, HumanEval) in a shuffled order per
prompt; every output is checked against plain `generate()`'s.

    python scripts/ab_auto_guard.py --threads 2 --rounds 5 [--num-prompts 3] [--max-new-tokens 256] [--drafter PATH]
        [--variants before,estimated,defaults]

Prints each variant's speedup over plain decoding (per round: median and range), its tau and median speedup per
prompt, its ratio to "before" per round, and the drafter's runs per round (median and range).
"""

import argparse
import contextlib
import os
import statistics
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import load_prompts, print_report, time_rounds  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--variants", default="before,estimated,defaults", help="which to time, comma-separated")
    args = parser.parse_args()

    import torch
    from interleaved_ab import load_smollm2_pair

    from transformers_dflash import draft_length
    from transformers_dflash.draft_length import AutoDraftLength

    core = {name: getattr(AutoDraftLength, name) for name in ("_step_cost", "wants_draft", "draft_beats_copies")}
    runs = {}  # variant -> drafter runs per call

    def measured_cost(self, width, seconds):
        return self.draft_seconds[-1] + seconds

    def rules(name, step_cost, median, skip_for_copies):
        memory = {}  # the variant's own, kept from call to call

        @contextlib.contextmanager
        def variant_rules():
            calls = runs.setdefault(name, [])
            calls.append(0)

            def counted(self):
                wanted = core["wants_draft"](self)
                calls[-1] += wanted
                return wanted

            AutoDraftLength._step_cost, AutoDraftLength.wants_draft = step_cost, counted
            if not skip_for_copies:
                AutoDraftLength.draft_beats_copies = lambda self, copy_expected, num_draft: True
            draft_length.statistics = types.SimpleNamespace(median=median)
            drafter.draft_length_memory = memory
            try:
                yield
            finally:
                for attribute, value in core.items():
                    setattr(AutoDraftLength, attribute, value)
                draft_length.statistics = statistics

        return variant_rules

    variants = {
        "before": rules("before", measured_cost, statistics.mean, False),
        "estimated": rules("estimated", core["_step_cost"], statistics.median, False),
        "defaults": rules("defaults", core["_step_cost"], statistics.median, True),
    }
    unknown = set(args.variants.split(",")) - set(variants)
    if unknown:
        parser.error(f"--variants: no variant {sorted(unknown)}; choose from {', '.join(variants)}")
    variants = {name: variants[name] for name in args.variants.split(",")}
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    prompts = load_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    timings = time_rounds(target, drafter, prompts, kwargs, variants, args.rounds, seed=args.threads)
    print_report(timings, args.threads, baseline="before" if "before" in variants else None)
    for name, calls in runs.items():
        timed = calls[len(prompts) :]  # after the warm-up round
        per_round = [sum(timed[i : i + len(prompts)]) for i in range(0, len(timed), len(prompts))]
        print(f"  {name}: drafter runs per round {statistics.median(per_round)} ({min(per_round)}-{max(per_round)})")


if __name__ == "__main__":
    main()
