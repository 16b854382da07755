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
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    import transformers_dflash as td
    from transformers_dflash import candidate_generator
    from transformers_dflash.bench.prompts import select_prompts
    from transformers_dflash.bench.single_stream import encode_prompt
    from transformers_dflash.data import load_humaneval_prompts, load_mtbench_prompts
    from transformers_dflash.ngram_lookup import CopyAcceptance, ngram_lookup_for

    def shared_lookup(setting, block_size, device):
        lookup = ngram_lookup_for(setting, block_size, device)
        if lookup is not None:
            table = CopyAcceptance(block_size)
            lookup.acceptance = dict.fromkeys(lookup.acceptance, table)
        return lookup

    factories = {"shared": shared_lookup, "by-length": ngram_lookup_for}
    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(args.drafter or td.SHIPPED_DRAFTER, dtype=target.dtype)
    texts = [("demo", DEMO_PROMPT)] + [
        (name, p)
        for name, source in (("mtbench", load_mtbench_prompts()), ("humaneval", load_humaneval_prompts()))
        for p in select_prompts(source, args.num_prompts)[1]
    ]
    prompts = [encode_prompt(tokenizer, p, "cpu") for _, p in texts]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    methods = ["plain", *factories]
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            order_rng = random.Random(threads)
            seconds = {(m, i): [] for m in methods for i in range(len(prompts))}
            steps = dict.fromkeys(factories, 0)
            new_tokens = 0
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for index, ids in enumerate(prompts):
                    outputs = {}
                    for method in order_rng.sample(methods, len(methods)):
                        extra = {}
                        if method != "plain":
                            candidate_generator.ngram_lookup_for = factories[method]
                            extra = dict(assistant_model=drafter)
                        start = time.perf_counter()
                        with torch.inference_mode():
                            outputs[method] = target.generate(ids, **kwargs, **extra)
                        elapsed = time.perf_counter() - start
                        if round_index:
                            seconds[(method, index)].append(elapsed)
                            if extra:
                                steps[method] += len(drafter.last_acceptance_lengths) - 1
                    if not all(torch.equal(outputs["plain"], outputs[m]) for m in factories):
                        raise SystemExit(f"prompt {index}: an output differs from plain generate()'s")
                    if round_index:
                        new_tokens += outputs["plain"].shape[1] - ids.shape[1]
            print(
                f"== {threads} thread(s): {len(prompts)} prompts (demo, MT-Bench, HumanEval), greedy, "
                f"{new_tokens // args.rounds} new tokens per round, {args.rounds} rounds; every output equal"
            )

            def pooled(method, r):
                return sum(seconds[(method, i)][r] for i in range(len(prompts)))

            for method in factories:
                per_round = [pooled("plain", r) / pooled(method, r) for r in range(args.rounds)]
                per_prompt = [
                    statistics.median(p / s for p, s in zip(seconds[("plain", i)], seconds[(method, i)]))
                    for i in range(len(prompts))
                ]
                # tau as `dflash bench` counts it: tokens per target forward after the prefill (its 1 token excluded)
                tau = (new_tokens - len(prompts) * args.rounds) / steps[method]
                print(
                    f"  {method}: {statistics.median(per_round):.3f}x ({min(per_round):.3f}-{max(per_round):.3f}) "
                    f"per round, tau {tau:.2f}; per prompt: "
                    + ", ".join(f"{texts[i][0]} {x:.2f}" for i, x in enumerate(per_prompt))
                )
            ratio = [pooled("shared", r) / pooled("by-length", r) for r in range(args.rounds)]
            print(f"  by-length / shared: {statistics.median(ratio):.3f}x ({min(ratio):.3f}-{max(ratio):.3f})")
    finally:
        candidate_generator.ngram_lookup_for = ngram_lookup_for


if __name__ == "__main__":
    main()
