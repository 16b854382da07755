"""A/B of `draft_length="auto"`'s trust rules at the drafter's defaults, in one process (docs/benchmarks.md).

"auto" learns each width's step cost and each copy depth's acceptance within a call. The core's rules ("new"): a
width measured fewer than `TRUSTED` times costs at most what the line through all steps says, a copy depth tried fewer
than `TRUSTED` times is rated no lower than the depth before, and a depth whose copy is proposed but not verified
keeps `FORGET` of its counts. The rules before ("old"): `TRUSTED = 0`, `FORGET = 1`, every measurement stands for the
whole call. Each repeat times plain `generate()`, the old rule and the new one on every prompt, interleaved per
prompt, the order reversed every other repeat; every output is checked against plain `generate()`'s.

    python scripts/ab_auto_trust.py --repeats 3 [--drafter PATH] [--json OUT.json]

Prints, per repeat: plain tokens/s, each rule's speedup over plain (total seconds over all prompts) and tau, and
new/old; then the medians with their range.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write every timed call here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModel

    import transformers_dflash as td
    from transformers_dflash.bench.prompts import select_prompts
    from transformers_dflash.bench.single_stream import encode_prompt
    from transformers_dflash.data import load_humaneval_prompts, load_mtbench_prompts
    from transformers_dflash.draft_length import AutoDraftLength
    from transformers_dflash.ngram_lookup import CopyAcceptance

    torch.set_num_threads(args.threads)
    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(args.drafter or td.SHIPPED_DRAFTER, dtype=target.dtype)
    prompts = [
        encode_prompt(tokenizer, p, "cpu")
        for source in (load_mtbench_prompts(), load_humaneval_prompts())
        for p in select_prompts(source, args.num_prompts)[1]
    ]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    target.generate(prompts[0], assistant_model=drafter, **{**kwargs, "max_new_tokens": 32})  # warm-up
    rules = {"old": (0, 1.0), "new": (AutoDraftLength.TRUSTED, CopyAcceptance.FORGET)}
    calls = []
    for repeat in range(args.repeats):
        methods = ["plain", "old", "new"] if repeat % 2 == 0 else ["new", "old", "plain"]
        for index, ids in enumerate(prompts):
            outputs = {}
            for method in methods:
                extra = {}
                if method != "plain":
                    AutoDraftLength.TRUSTED = CopyAcceptance.TRUSTED = rules[method][0]
                    CopyAcceptance.FORGET = rules[method][1]
                    drafter.draft_length_memory.clear()  # every call afresh: neither rule inherits the other's figures
                    extra = dict(assistant_model=drafter)
                start = time.perf_counter()
                outputs[method] = target.generate(ids, **kwargs, **extra)
                seconds = time.perf_counter() - start
                new = outputs[method].shape[1] - ids.shape[1]
                # tau as `dflash bench` counts it: tokens per target forward after the prefill (its 1 token excluded)
                steps = len(drafter.last_acceptance_lengths) - 1 if extra else new - 1
                calls.append(dict(repeat=repeat, prompt=index, method=method, seconds=seconds, new=new, steps=steps))
            if not all(torch.equal(outputs["plain"], outputs[m]) for m in ("old", "new")):
                raise SystemExit(f"prompt {index}: an output differs from plain generate()'s")
    AutoDraftLength.TRUSTED = CopyAcceptance.TRUSTED = rules["new"][0]
    CopyAcceptance.FORGET = rules["new"][1]
    if args.json:
        Path(args.json).write_text(json.dumps(calls, indent=1))

    def total(repeat, method, key):
        return sum(c[key] for c in calls if c["repeat"] == repeat and c["method"] == method)

    summary = {"old": [], "new": [], "new/old": []}
    for repeat in range(args.repeats):
        plain, new_tokens = total(repeat, "plain", "seconds"), total(repeat, "plain", "new")
        line = f"repeat {repeat}: plain {new_tokens / plain:.2f} tokens/s"
        for method in ("old", "new"):
            speedup = plain / total(repeat, method, "seconds")
            summary[method].append(speedup)
            tau = (new_tokens - len(prompts)) / total(repeat, method, "steps")
            line += f"; {method} {speedup:.2f}x, tau {tau:.2f}"
        summary["new/old"].append(summary["new"][-1] / summary["old"][-1])
        print(f"{line}; new/old {summary['new/old'][-1]:.2f}x")
    for name, values in summary.items():
        print(f"{name}: median {statistics.median(values):.2f}x ({min(values):.2f}x-{max(values):.2f}x)")


if __name__ == "__main__":
    main()
