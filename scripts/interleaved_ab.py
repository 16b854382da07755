"""What the A/B scripts (`ab_*.py` beside this one) share: their prompts, rounds that time plain `generate()` and each
variant on every prompt in a shuffled order, the check that every output equals plain decoding's, and the report.
Not a test; imported by those scripts (they put `src/` on the path first)."""

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."


def load_prompts(tokenizer, num_prompts: int, demo: bool = True):
    """[(name, input ids)]: the demo's prompt (unless `demo` is False), then `num_prompts` MT-Bench and `num_prompts`
    HumanEval prompts."""
    from transformers_dflash.bench.prompts import select_prompts
    from transformers_dflash.bench.single_stream import encode_prompt
    from transformers_dflash.data import load_humaneval_prompts, load_mtbench_prompts

    texts = [("demo", DEMO_PROMPT)] * demo + [
        (name, p)
        for name, source in (("mtbench", load_mtbench_prompts()), ("humaneval", load_humaneval_prompts()))
        for p in select_prompts(source, num_prompts)[1]
    ]
    return [(name, encode_prompt(tokenizer, p, "cpu")) for name, p in texts]


@dataclass
class Timings:
    names: list[str]  # of the prompts
    seconds: dict  # (method, prompt index) -> seconds of each timed round
    steps: dict  # variant -> target forwards after the prefill, all timed rounds
    new_tokens: int  # all timed rounds
    rounds: int

    def pooled(self, method: str, round_index: int) -> float:
        return sum(self.seconds[(method, i)][round_index] for i in range(len(self.names)))

    def ratios(self, slower: str, faster: str) -> list[float]:
        """Per round: total seconds of `slower` over total seconds of `faster`."""
        return [self.pooled(slower, r) / self.pooled(faster, r) for r in range(self.rounds)]


def time_rounds(target, drafter, prompts, kwargs: dict, variants: dict[str, Callable], rounds: int, seed: int = 0):
    """`rounds` timed rounds after one warm-up round. In each, every prompt runs plain `generate()` and each variant
    (`variants[name]()` is a context manager that sets the variant's rules; the drafter is the assistant), in a
    shuffled order; an output that differs from plain `generate()`'s stops the run."""
    import torch

    methods = ["plain", *variants]
    order_rng = random.Random(seed)
    seconds = {(m, i): [] for m in methods for i in range(len(prompts))}
    steps = dict.fromkeys(variants, 0)
    new_tokens = 0
    for round_index in range(rounds + 1):  # round 0 warms up
        for index, (_, ids) in enumerate(prompts):
            outputs = {}
            for method in order_rng.sample(methods, len(methods)):
                rules = variants[method]() if method != "plain" else contextlib.nullcontext()
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
    return Timings([name for name, _ in prompts], seconds, steps, new_tokens, rounds)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def print_report(timings: Timings, threads: int, baseline: str | None = None) -> None:
    """Plain tokens/s, then per variant: speedup over plain per round (median, range), tau, median per prompt, and
    (with `baseline`, another variant) the variant over it per round."""
    rounds, names = timings.rounds, timings.names
    plain_rate = [timings.new_tokens / rounds / timings.pooled("plain", r) for r in range(rounds)]
    print(
        f"{threads} thread(s), {len(names)} prompts ({', '.join(dict.fromkeys(names))}), greedy, "
        f"{timings.new_tokens // rounds} new tokens per round, {rounds} rounds; every output equal to plain's"
    )
    print(f"  plain: {statistics.median(plain_rate):.1f} tokens/s ({min(plain_rate):.1f}-{max(plain_rate):.1f})")
    for method, steps in timings.steps.items():
        per_prompt = [
            statistics.median(p / s for p, s in zip(timings.seconds[("plain", i)], timings.seconds[(method, i)]))
            for i in range(len(names))
        ]
        # tau as `dflash bench` counts it: tokens per target forward after the prefill (its 1 token excluded)
        tau = (timings.new_tokens - len(names) * rounds) / steps
        line = (
            f"  {method}: {spread(timings.ratios('plain', method))} per round, tau {tau:.2f}; per prompt: "
            + ", ".join(f"{name} {x:.2f}" for name, x in zip(names, per_prompt))
        )
        if baseline is not None and method != baseline:
            line += f"; over {baseline} {spread(timings.ratios(baseline, method))}"
        print(line)


def load_smollm2_pair(drafter_path=None):
    """(target, tokenizer, drafter): SmolLM2-135M-Instruct and a drafter for it (default: the shipped one) in the
    target's dtype."""
    from transformers import AutoModel

    import transformers_dflash as td

    target, tokenizer = td.load_smollm2()
    drafter = AutoModel.from_pretrained(drafter_path or td.SHIPPED_DRAFTER, dtype=target.dtype)
    return target, tokenizer, drafter


def add_comparison_arguments(parser, threads: list[int], rounds: int, max_new_tokens: int) -> None:
    """The options `compare_per_thread_count` reads (and `--drafter`, for `load_smollm2_pair`), with a script's own
    defaults."""
    parser.add_argument("--threads", type=int, nargs="+", default=threads)
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset (MT-Bench, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")


def compare_per_thread_count(target, tokenizer, drafter, variants: dict, args, slower: str, faster: str) -> None:
    """For each of `args.threads`: `time_rounds` of the variants on the demo's prompt and `args.num_prompts` MT-Bench
    and HumanEval prompts (`args.max_new_tokens`, `args.rounds`), the report, and `faster` over `slower` per round."""
    import torch

    prompts = load_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    for threads in args.threads:
        torch.set_num_threads(threads)
        timings = time_rounds(target, drafter, prompts, kwargs, variants, args.rounds, seed=threads)
        print_report(timings, threads)
        print(f"  {faster} / {slower}: {spread(timings.ratios(slower, faster))}")
