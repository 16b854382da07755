"""Two-turn MT-Bench conversations: what carrying one DynamicCache through the turns does to DFlash decoding.

transformers' pattern for a chat passes one `DynamicCache` to every `generate()` call; each call fills it and the next
reads only the new turn. DFlash decoding continues such a cache (README, "Use it"), but its drafter then sees the
target's features of the new turn only. Three methods answer the same second turns, in a shuffled order per question:

- plain: `generate()` with the cache carried over from the first turn (the pattern as transformers documents it);
- dflash, cache carried: the same call with the drafter at its defaults;
- dflash, whole conversation: the drafter at its defaults and no cache, so the target re-reads the first turn and
  the drafter gets its features too.

The first turn is answered once per question (by plain `generate()`, the same tokens every method would give) and
kept in a cache each carried method copies. The second turn's prompt is the first answer's tokens followed by the
chat template's next user turn, so that the cache holds an exact prefix of it. Each second turn is timed; every
output must equal plain decoding's. Prints tokens/s of the second turns, each DFlash method's speedup over plain per
round (median and range) with its tau, and the carried method over the re-reading one.

    python scripts/bench_conversation.py [--threads 2] [--rounds 3] [--num-questions 6] [--max-new-tokens 256]
"""

import argparse
import copy
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interleaved_ab import load_smollm2_pair, spread  # noqa: E402  (beside this script)

METHODS = ("plain", "dflash, cache carried", "dflash, whole conversation")


def second_turn_ids(tokenizer, first_ids, first_answer, question):
    """The first turn's prompt and answer, then the second user turn and the assistant header, as token ids: the
    answer's own tokens (not a re-tokenization of its text), so that a cache of the first turn is a prefix."""
    import torch

    messages = [{"role": "user", "content": question["turns"][0]}, {"role": "assistant", "content": "A"}]
    with_answer = tokenizer.apply_chat_template(messages, tokenize=False)
    messages += [{"role": "user", "content": question["turns"][1]}]
    with_second = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    closing = with_answer[with_answer.rindex("A") + 1 :]  # what the template puts after an answer
    if first_answer[-1] == tokenizer.eos_token_id and closing.startswith(tokenizer.eos_token):
        closing = closing[len(tokenizer.eos_token) :]  # the answer ended with the template's own end token
    suffix = closing + with_second[len(with_answer) :]
    suffix_ids = tokenizer(suffix, add_special_tokens=False, return_tensors="pt").input_ids
    return torch.cat([first_ids, first_answer[None], suffix_ids], dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--num-questions", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    args = parser.parse_args()

    import torch
    from transformers import DynamicCache

    from transformers_dflash.bench.prompts import select_prompts
    from transformers_dflash.data.eval_sets import load_mtbench_questions
    from transformers_dflash.target_model import cache_keyword

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_smollm2_pair(args.drafter)
    keyword = cache_keyword(target)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    questions = select_prompts(load_mtbench_questions(), args.num_questions)[1]

    conversations = []  # (second turn's ids, cache of the first turn)
    for question in questions:
        messages = [{"role": "user", "content": question["turns"][0]}]
        first_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        first_ids = getattr(first_ids, "input_ids", first_ids)  # a BatchEncoding under transformers 5
        cache = DynamicCache()
        with torch.inference_mode():
            first = target.generate(first_ids, **settings, **{keyword: cache})
        ids = second_turn_ids(tokenizer, first_ids, first[0, first_ids.shape[1] :], question)
        conversations.append((ids, cache))

    order = random.Random(0)
    seconds = {method: [0.0] * args.rounds for method in METHODS}
    steps = dict.fromkeys(METHODS[1:], 0)
    new_tokens = 0
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for ids, cache in conversations:
            outputs = {}
            for method in order.sample(METHODS, len(METHODS)):
                kwargs = dict(settings)
                if method != "dflash, whole conversation":
                    kwargs[keyword] = copy.deepcopy(cache)
                if method != "plain":
                    kwargs["assistant_model"] = drafter
                start = time.perf_counter()
                with torch.inference_mode():
                    outputs[method] = target.generate(ids, **kwargs)
                if round_index:
                    seconds[method][round_index - 1] += time.perf_counter() - start
                    if method != "plain":
                        steps[method] += len(drafter.last_acceptance_lengths) - 1
            if not all(torch.equal(outputs["plain"], out) for out in outputs.values()):
                raise SystemExit("a second turn differs from plain generate()'s")
            if round_index:
                new_tokens += outputs["plain"].shape[1] - ids.shape[1]
        print(f"round {round_index} done", file=sys.stderr, flush=True)

    rounds = args.rounds
    per_round = new_tokens // rounds
    prompt_lengths = [ids.shape[1] for ids, _ in conversations]
    print(
        f"{args.threads} thread(s), {len(conversations)} MT-Bench second turns (prompts of "
        f"{min(prompt_lengths)}-{max(prompt_lengths)} tokens, {statistics.median(prompt_lengths):.0f} median), greedy, "
        f"{per_round} new tokens per round, {rounds} rounds; every output equal to plain's"
    )
    rates = [per_round / s for s in seconds["plain"]]
    print(f"  plain, cache carried: {statistics.median(rates):.1f} tokens/s ({min(rates):.1f}-{max(rates):.1f})")
    for method in METHODS[1:]:
        ratios = [p / s for p, s in zip(seconds["plain"], seconds[method])]
        tau = (new_tokens - len(conversations) * rounds) / steps[method]
        print(f"  {method}: {spread(ratios)} over plain per round, tau {tau:.2f}")
    carried, reread = seconds[METHODS[1]], seconds[METHODS[2]]
    print(f"  cache carried over whole conversation: {spread([r / c for c, r in zip(carried, reread)])} per round")


if __name__ == "__main__":
    main()
