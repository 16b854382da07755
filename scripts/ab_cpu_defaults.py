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
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
VARIANTS = ("static", "measured", "realised", "defaults")


def static_rule(flat, weight) -> bool:
    """The kernel rule before measured choices (commit 0a90bdc): fixed by row count and thread count."""
    import torch

    rows, tall = flat.shape[0], weight.shape[0] >= 8 * weight.shape[1]
    if torch.get_num_threads() == 1:
        return 2 <= rows <= (8 if tall else 4)
    return (1 if tall else 2) <= rows <= 256


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
    from transformers_dflash.bench.prompts import select_prompts
    from transformers_dflash.bench.single_stream import encode_prompt
    from transformers_dflash.data import load_humaneval_prompts, load_mtbench_prompts
    from transformers_dflash.draft_length import AutoDraftLength

    measure, record = kernels._measure, AutoDraftLength.record
    tables = {variant: {} for variant in variants}
    memory = {}  # the `defaults` variant's

    @contextlib.contextmanager
    def variant_rules(variant):
        kernels._transposed_is_faster = tables[variant]
        kernels._measure = static_rule if variant == "static" else measure
        if variant in ("static", "measured"):  # confidences alone: the realised rate never gets a sample
            AutoDraftLength.record = lambda self, w, s, d=None, accepted=None: record(self, w, s, d)
        drafter.draft_length_memory = memory if variant == "defaults" else {}
        try:
            yield
        finally:
            kernels._measure, AutoDraftLength.record = measure, record

    torch.set_num_threads(args.threads)
    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(args.drafter or td.SHIPPED_DRAFTER, dtype=target.dtype)
    texts = [("demo", DEMO_PROMPT)] + [
        (name, p)
        for name, source in (("mtbench", load_mtbench_prompts()), ("humaneval", load_humaneval_prompts()))
        for p in select_prompts(source, args.num_prompts)[1]
    ]
    prompts = [encode_prompt(tokenizer, p, "cpu") for _, p in texts]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    methods = ["plain", *variants]
    order_rng = random.Random(0)
    seconds = {(m, i): [] for m in methods for i in range(len(prompts))}
    steps = dict.fromkeys(variants, 0)
    new_tokens = 0
    for round_index in range(args.rounds + 1):  # round 0 warms up (and measures each variant's kernels)
        for index, ids in enumerate(prompts):
            outputs = {}
            for method in order_rng.sample(methods, len(methods)):
                rules = variant_rules(method) if method != "plain" else contextlib.nullcontext()
                extra = dict(assistant_model=drafter) if method != "plain" else {}
                with rules:
                    start = time.perf_counter()
                    with torch.inference_mode():
                        outputs[method] = target.generate(ids, **kwargs, **extra)
                    elapsed = time.perf_counter() - start
                if round_index:
                    seconds[(method, index)].append(elapsed)
                    if extra:
                        steps[method] += len(drafter.last_acceptance_lengths) - 1
            if not all(torch.equal(outputs["plain"], outputs[m]) for m in variants):
                raise SystemExit(f"prompt {index}: an output differs from plain generate()'s")
            if round_index:
                new_tokens += outputs["plain"].shape[1] - ids.shape[1]
        print(f"round {round_index} done", file=sys.stderr, flush=True)

    def pooled(method, r):
        return sum(seconds[(method, i)][r] for i in range(len(prompts)))

    plain_rate = [new_tokens / args.rounds / pooled("plain", r) for r in range(args.rounds)]
    print(
        f"{args.threads} thread(s), {len(prompts)} prompts (demo, MT-Bench, HumanEval), greedy, "
        f"{new_tokens // args.rounds} new tokens per round, {args.rounds} rounds; every output equal to plain's"
    )
    print(f"  plain: {statistics.median(plain_rate):.1f} tokens/s ({min(plain_rate):.1f}-{max(plain_rate):.1f})")
    for method in variants:
        per_round = [pooled("plain", r) / pooled(method, r) for r in range(args.rounds)]
        per_prompt = [
            statistics.median(p / s for p, s in zip(seconds[("plain", i)], seconds[(method, i)]))
            for i in range(len(prompts))
        ]
        tau = (new_tokens - len(prompts) * args.rounds) / steps[method]  # tokens per target forward after the prefill
        line = (
            f"  {method}: {statistics.median(per_round):.3f}x ({min(per_round):.3f}-{max(per_round):.3f}) per round, "
            f"tau {tau:.2f}; per prompt: " + ", ".join(f"{texts[i][0]} {x:.2f}" for i, x in enumerate(per_prompt))
        )
        if method != "static" and "static" in variants:
            ratio = [pooled("static", r) / pooled(method, r) for r in range(args.rounds)]
            line += f"; over static {statistics.median(ratio):.3f}x ({min(ratio):.3f}-{max(ratio):.3f})"
        print(line)


if __name__ == "__main__":
    main()
