"""The first generate() call of a new process, with and without the kernel choices of an earlier process on the same
machine (`kernel_choices.py`; docs/benchmarks.md, "Kernel choices kept between processes"). Not a test.

Runs `--processes` pairs of new processes, alternating: one with the choices kept in memory only
(`DFLASH_KERNEL_CACHE=off`: it measures them, as every process did before), one reading them from a folder that the
very first process filled (`kept`). Each loads SmolLM2-135M-Instruct and the shipped drafter and times two DFlash
calls on the demo's prompt at the defaults (greedy, `--max-new-tokens`); the report gives, per variant, the median
[min-max] of the first call, of the second, and of their ratio.

    python scripts/bench_first_call.py --threads 2 --processes 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One new process: two timed DFlash calls; prints their seconds as JSON."""
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from interleaved_ab import DEMO_PROMPT, load_smollm2_pair

    from transformers_dflash.bench.single_stream import encode_prompt

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_smollm2_pair()
    ids = encode_prompt(tokenizer, DEMO_PROMPT, "cpu")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        with torch.inference_mode():
            target.generate(ids, assistant_model=drafter, **kwargs)
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def spread(values) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=3, help="processes per variant")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    command = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
    command += ["--max-new-tokens", str(args.max_new_tokens)]
    results = {"off": [], "kept": []}
    with tempfile.TemporaryDirectory() as folder:
        # The first process fills the folder (it measures, like "off"); the "kept" processes after it read it.
        environment = dict(os.environ, HF_HUB_OFFLINE="1")
        subprocess.run(command, env=dict(environment, DFLASH_KERNEL_CACHE=folder), check=True, capture_output=True)
        for index in range(2 * args.processes):
            variant = ("off", "kept")[index % 2]
            setting = {"DFLASH_KERNEL_CACHE": "off" if variant == "off" else folder}
            done = subprocess.run(command, env=environment | setting, check=True, capture_output=True, text=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"process {index + 1}: {variant} {results[variant][-1]}", file=sys.stderr, flush=True)
    print(f"\nDFlash at the defaults, demo prompt, {args.max_new_tokens} new tokens, {args.threads} thread(s), seconds")
    print("| kernel choices | first call | second call | first / second |")
    print("|---|---:|---:|---:|")
    for variant, label in (("off", "measured in the process"), ("kept", "read from an earlier process")):
        first, second = [r[0] for r in results[variant]], [r[1] for r in results[variant]]
        print(f"| {label} | {spread(first)} | {spread(second)} | {spread([f / s for f, s in results[variant]])} |")


if __name__ == "__main__":
    main()
