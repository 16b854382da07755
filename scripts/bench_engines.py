"""Tokens/s and greedy agreement of the `dflash regenerate` engines on SmolLM2-135M-Instruct, side by side in one run.

    PYTHONPATH=src python scripts/bench_engines.py [--repeats 2] [--num-prompts 64] [--max-new-tokens 256] [--threads 2]
        [--server-url http://127.0.0.1:8080 --concurrency 16]   # e.g. llama.cpp's llama-server on the target's GGUF

Every engine answers the same chat prompts (the first --num-prompts validation prompts: ShareGPT + composed), greedy.
Engines run interleaved, --repeats rounds. Agreement is measured against the float32 target decoding each prompt alone
(transformers generate(), batch 1: no padding), which is timed too: "identical" is the fraction of responses equal to
it, "prefix tokens" the fraction of its tokens that come before the first difference. With the reference skipped
(`--skip reference`), agreement is measured against CTranslate2 float32, which gave the reference's answers on every
prompt so far (docs/data-engines.md).

The bfloat16 rows run the same engine on a bfloat16 copy of the target, once with the engine's reserved KV cache and
once with transformers' own `DynamicCache` (what the engine used before), so the cache's gain is measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from transformers_dflash.data import load_prompts
from transformers_dflash.data.engines import CTranslate2Engine, OpenAIEngine, TransformersEngine, transformers_engine
from transformers_dflash.data.regeneration import _eos_ids, _pad_id
from transformers_dflash.runtime import chat_token_ids
from transformers_dflash.smollm2 import load_smollm2


class DynamicCacheEngine(TransformersEngine):
    """The transformers engine with transformers' own `DynamicCache` instead of the reserved one."""

    def _generate_batch(self, prompts, config):
        reserved = transformers_engine.reserved_kv_cache
        transformers_engine.reserved_kv_cache = lambda *args: None  # generate() then makes its own cache
        try:
            return super()._generate_batch(prompts, config)
        finally:
            transformers_engine.reserved_kv_cache = reserved


def build_engines(model, tokenizer, threads: int, server_url: str | None = None, concurrency: int = 16) -> dict:
    eos, pad = _eos_ids(model, tokenizer), _pad_id(tokenizer, _eos_ids(model, tokenizer))
    engines = {
        "reference: transformers batch 1": TransformersEngine(model, eos, pad, batch_size=1),
        "transformers batch 64, arbitrary order": TransformersEngine(
            model, eos, pad, batch_size=64, pad_fraction=float("inf")
        ),
        "transformers batch 16, length buckets": TransformersEngine(model, eos, pad, batch_size=16),
        "ctranslate2 float32, batch 32": CTranslate2Engine.from_transformers(
            model, tokenizer, eos, compute_type="float32", batch_size=32, threads=threads
        ),
        "ctranslate2 int8, batch 32": CTranslate2Engine.from_transformers(
            model, tokenizer, eos, compute_type="int8", batch_size=32, threads=threads
        ),
    }
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for batch in (16, 64):
        engines[f"transformers bfloat16, buckets of up to {batch}"] = TransformersEngine(
            bf16, eos, pad, batch_size=batch
        )
    engines["transformers bfloat16, buckets of up to 64, transformers' DynamicCache"] = DynamicCacheEngine(
        bf16, eos, pad, batch_size=64
    )
    if server_url:  # e.g. llama.cpp's llama-server on the target's GGUF; its tokenizer is checked first
        server = OpenAIEngine(server_url, tokenizer, eos, concurrency=concurrency)
        server.check_server()
        engines[f"server {server_url}, {concurrency} requests in flight"] = server
    return engines


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    identical = sum(o == r for o, r in zip(outputs, reference)) / len(reference)
    prefix = 0
    for o, r in zip(outputs, reference):
        n = 0
        while n < min(len(o), len(r)) and o[n] == r[n]:
            n += 1
        prefix += n
    return identical, prefix / sum(len(r) for r in reference)


def print_table(engines: dict, timings: dict, outputs: dict, rounds: int) -> None:
    first = next(iter(engines))
    reference = outputs[first][0] if "reference" in first else None
    if reference is None and outputs.get("ctranslate2 float32, batch 32"):
        reference = outputs["ctranslate2 float32, batch 32"][0]
        print("(agreement against CTranslate2 float32: the batch-1 reference was skipped)")
    print(
        f"\nafter round {rounds}: load average {os.getloadavg()[0]:.2f} (2 cores; the machine is shared with other "
        "work)"
    )
    print("| engine | tok/s median | min-max | runs | identical responses | prefix tokens |")
    print("|---|---|---|---|---|---|")
    for name in engines:
        rates = timings[name]
        ident = prefix = float("nan")
        if reference is not None:
            ident, prefix = agreement(outputs[name][0], reference)
        stable = all(o == outputs[name][0] for o in outputs[name])
        print(
            f"| {name} | {statistics.median(rates):.1f} | {min(rates):.1f}-{max(rates):.1f} | {len(rates)} | "
            f"{ident:.3f} | {prefix:.3f} |" + ("" if stable else " (outputs differed between runs)"),
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", nargs="*", default=[], help="engine names (substrings) to leave out")
    parser.add_argument(
        "--once",
        nargs="*",
        default=["reference", "batch 64"],
        help="engines (substrings) timed in the first round only (the slow ones)",
    )
    parser.add_argument("--server-url", default=None, help="also time an OpenAI-compatible server serving the target")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight to --server-url")
    parser.add_argument("--json", default=None, help="also write the raw timings here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    _, prompts = load_prompts("validation", limit=args.num_prompts)
    prompt_ids = [chat_token_ids(tokenizer, p) for p in prompts]
    lengths = sorted(len(p) for p in prompt_ids)
    print(
        f"{len(prompt_ids)} prompts, {lengths[0]}..{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
        f"greedy, {args.max_new_tokens} new tokens max, {args.threads} threads; load average before "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    engines = {
        k: v
        for k, v in build_engines(model, tokenizer, args.threads, args.server_url, args.concurrency).items()
        if not any(s in k for s in args.skip)
    }
    for engine in engines.values():  # warm-up (first-call allocations, thread pools)
        engine.generate(prompt_ids[:2], 4)
    timings: dict[str, list[float]] = {k: [] for k in engines}
    outputs: dict[str, list[list[list[int]]]] = {k: [] for k in engines}
    for r in range(args.repeats):
        for name, engine in engines.items():
            if r and any(s in name for s in args.once):
                continue
            start = time.perf_counter()
            out = engine.generate(prompt_ids, args.max_new_tokens)
            seconds = time.perf_counter() - start
            tokens = sum(len(o) for o in out)
            timings[name].append(tokens / seconds)
            outputs[name].append(out)
            print(
                f"  round {r + 1} {name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        print_table(engines, timings, outputs, r + 1)
    if args.json:
        Path(args.json).write_text(json.dumps({"timings": timings, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
