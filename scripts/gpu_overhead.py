#!/usr/bin/env python
"""Per-step overhead of DFlash decoding on a Qwen3-8B-shaped target with random weights (issue #4, GPU part).

Acceptance does not matter here, cost does: a random drafter proposes garbage, so the acceptance length is EMULATED.
Every step runs for real (drafter forward, target verification of the whole block, acceptance, cache crops, context
growth, Python: the actual `target.generate(assistant_model=drafter)` path), but the target's greedy choices at the
verified positions are overridden so that the first k drafts "match" and the next does not, with k following a plan
whose mean acceptance length is the requested tau. (So the emulated runs' tokens are meaningless; a separate run
without emulation checks that DFlash's output equals plain greedy decoding.) Overriding choices rather than drafts
keeps the emulation independent of bf16 rounding: a 16-token verification may round differently from 1-token
decoding and flip a near-tie of random weights.

    python scripts/gpu_overhead.py                       # H200: bf16, SDPA (+ FlashAttention-2 when installed)
    python scripts/gpu_overhead.py --tiny --device cpu   # a tiny shape, any machine (slow paths, for checking)
    python scripts/gpu_overhead.py --json out.json --tau 6.49 --contexts 512,2048

It measures, per attention backend and per context length C (the prompt / KV-cache length):
- target forward of 1 token and of `block_size` tokens on a cache of C tokens (kernel time, no generate());
- drafter forward (`DFlashCandidateGenerator.draft`) with a drafter cache of C context rows;
- plain `generate()` time per token, and the DFlash step time inside `generate()` at the emulated tau;
- r = t_step / t_plain_token (= tau / speedup, the per-step overhead; 1.0 is ideal) and speedup = tau / r;
- where a DFlash step's time goes: draft, verify (target forward), cache crops, acceptance/commit, the rest (Python).

No network, no Hub: the models are built in-process from configs; run it from the repository root (it finds
`src/` by itself). Prints a Markdown report; `--json` also writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if (ROOT / "src" / "transformers_dflash").is_dir():
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (6-layer target, hidden 128) for a CPU check")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--attn",
        default=None,
        help="comma-separated backends (default: sdpa, plus flash_attention_2 when flash_attn is installed)",
    )
    p.add_argument("--contexts", default=None, help="KV-cache lengths (default: 512,2048; --tiny: 64,256)")
    p.add_argument("--tau", type=float, default=6.49, help="acceptance length to emulate (published Qwen3-8B mean)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=None, help="default: 5 (--tiny: 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per generate() run (default 128; tiny 48)")
    p.add_argument("--iters", type=int, default=None, help="timed repetitions of each forward (default 20; tiny 5)")
    p.add_argument("--runs", type=int, default=3, help="timed generate() runs per method (interleaved)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top ops of DFlash steps")
    p.add_argument("--json", default=None, help="write the measurements here")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters, warmup=2):
    """Median seconds of `fn()` over `iters` calls (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_models(shape, drafter_layers, block_size, dtype, device, attn):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from transformers_dflash import DFlashDraftModel

    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    target.eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(target, num_layers=drafter_layers, block_size=block_size).eval()
    drafter.draft_length, drafter.ngram_lookup = "full", 0  # every block verified whole: the step the paper measures
    drafter.config._attn_implementation = attn
    return target, drafter


def set_attention(target, drafter, attn):
    target.set_attn_implementation(attn)
    drafter.config._attn_implementation = attn


def cache_kwarg(target):
    import inspect

    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


# ----------------------------------------------------------------------------------------------------------------------
# Kernel-level timings


@torch.inference_mode()
def forward_timings(target, drafter, context, block_size, tau, iters, device):
    """Target forward of 1 and of block_size tokens on a C-token cache; drafter forward on C cached context rows with
    1 and round(tau) new context rows (a step brings the features of the anchor + accepted drafts)."""
    from transformers.cache_utils import DynamicCache

    from transformers_dflash import DFlashCandidateGenerator

    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    key = cache_kwarg(target)
    cache = DynamicCache()
    target(input_ids=prompt, use_cache=True, logits_to_keep=1, **{key: cache})

    def verify(n):
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
        positions = torch.arange(context, context + n, device=device)[None]

        def run():
            target(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=n, **{key: cache})
            cache.crop(-n)

        return run

    out = {
        "verify_1_ms": 1000 * timed(verify(1), device, iters),
        "verify_block_ms": 1000 * timed(verify(block_size), device, iters),
    }

    generator = DFlashCandidateGenerator(drafter, target)
    try:
        k_features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        dtype = next(target.parameters()).dtype
        features = torch.randn(1, context, k_features, generator=g).to(device, dtype)
        anchor = prompt[:, -1]
        generator.draft(
            anchor, torch.tensor([context], device=device), features, torch.arange(context, device=device)[None]
        )
        cached = generator.cache.context_length
        cached_positions = generator.cache.positions.clone()

        def draft(new):
            feats = features[:, :new]
            pos = torch.arange(cached, cached + new, device=device)[None]
            anchor_pos = torch.tensor([cached + new], device=device)

            def run():
                generator.cache.context_length = cached  # forget what the previous call appended
                generator.cache.positions = cached_positions
                generator.draft(anchor, anchor_pos, feats, pos)

            return run

        out["draft_1_ms"] = 1000 * timed(draft(1), device, iters)
        out["draft_tau_ms"] = 1000 * timed(draft(max(1, round(tau))), device, iters)
    finally:
        generator.close()
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Emulated acceptance inside generate()


class AcceptancePlan:
    """Accepted drafts per step so that the mean of (accepted + 1) approaches tau (error diffusion)."""

    def __init__(self, tau, max_accept):
        self.target = max(0.0, tau - 1.0)
        self.max_accept = max_accept
        self.debt = 0.0

    def next(self):
        want = self.target + self.debt
        k = max(0, min(self.max_accept, int(math.floor(want + 0.5))))
        self.debt = want - k
        return k


@contextlib.contextmanager
def emulate_acceptance(tau, block_size, vocab):
    """Patch the decoding loop so that each verification step accepts k drafts, k following `AcceptancePlan(tau)`:
    the drafter and the target run for real; after the target's greedy choices are computed (`choose_tokens`), the first
    k are replaced by the drafts of that step and choice k is made to differ from draft k."""
    from transformers_dflash import candidate_generator, decoding

    plan = AcceptancePlan(tau, block_size - 1)
    pending = []
    generator_class = candidate_generator.DFlashCandidateGenerator
    original_draft, original_choose = generator_class.draft, decoding.choose_tokens

    @functools.wraps(original_draft)
    def draft(self, *args, **kwargs):
        drafts, confidence = original_draft(self, *args, **kwargs)
        pending[:] = [drafts]
        return drafts, confidence

    @functools.wraps(original_choose)
    def choose(processed, do_sample):
        choices = original_choose(processed, do_sample)
        if not pending:  # the prefill, or a step without drafts
            return choices
        drafts = pending.pop()
        width = min(drafts.shape[1], choices.shape[1] - 1)  # the loop may verify fewer drafts than were proposed
        k = min(plan.next(), width)
        choices = choices.clone()
        choices[:, :k] = drafts[:, :k]
        if k < width:
            clash = choices[:, k] == drafts[:, k]
            choices[:, k] = torch.where(clash, (drafts[:, k] + 1) % vocab, choices[:, k])
        return choices

    generator_class.draft, decoding.choose_tokens = draft, choose
    try:
        yield
    finally:
        generator_class.draft, decoding.choose_tokens = original_draft, original_choose


# ----------------------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_timings(target, drafter, context, new_tokens, tau, runs, device, torch_profile=False):
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    common = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    reference = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)[0]

    def plain():
        return target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)

    def prefill_only():
        return target.generate(prompt, max_new_tokens=1, **common)

    def dflash():
        with emulate_acceptance(tau, drafter.config.block_size, vocab):
            return target.generate(prompt, assistant_model=drafter, max_new_tokens=new_tokens, **common)

    # Losslessness, without emulation (in bf16 a near-tie may legitimately flip: see the module docstring).
    real = target.generate(prompt, assistant_model=drafter, max_new_tokens=new_tokens, **common)[0]
    diff = next((i for i, (a, b) in enumerate(zip(real.tolist(), reference.tolist())) if a != b), None)
    for fn in (prefill_only, plain, dflash):  # warm-up
        fn()
    t_prefill, t_plain, t_dflash, steps, accepted = [], [], [], [], []
    for _ in range(runs):
        for name, fn, store in (
            ("prefill", prefill_only, t_prefill),
            ("plain", plain, t_plain),
            ("dflash", dflash, t_dflash),
        ):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            store.append(time.perf_counter() - start)
            if name == "dflash":
                lengths = list(drafter.last_acceptance_lengths)
                steps.append(len(lengths) - 1)
                accepted.extend(lengths[1:])
    prefill = statistics.median(t_prefill)
    plain_total = statistics.median(t_plain)
    dflash_total = statistics.median(t_dflash)
    n_steps = statistics.median(steps)
    tau_measured = sum(accepted) / len(accepted) if accepted else math.nan
    t_plain_token = (plain_total - prefill) / max(1, new_tokens - 1)
    t_step = (dflash_total - prefill) / max(1, n_steps)
    result = {
        "prefill_ms": 1000 * prefill,
        "plain_total_ms": 1000 * plain_total,
        "dflash_total_ms": 1000 * dflash_total,
        "plain_ms_per_token": 1000 * t_plain_token,
        "dflash_step_ms": 1000 * t_step,
        "steps": n_steps,
        "tau_emulated": tau_measured,
        "r": t_step / t_plain_token,
        "speedup_end_to_end": plain_total / dflash_total,
        "speedup_decode_only": (plain_total - prefill) / max(1e-9, dflash_total - prefill),
        "outputs_equal": diff is None,
        "first_difference": None if diff is None else diff - context,
    }

    # Where a step's time goes (a separate run, with device syncs at every boundary).
    from transformers_dflash.bench import StepProfiler

    with StepProfiler(target, "dflash", drafter) as profiler:
        dflash()
    result["breakdown"] = profiler.breakdown()

    if torch_profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as p:
            dflash()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        result["torch_profile"] = p.key_averages().table(sort_by=sort, row_limit=20)
    return result


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = TINY if args.tiny else QWEN3_8B
    contexts = [int(c) for c in (args.contexts or ("64,256" if args.tiny else "512,2048")).split(",")]
    drafter_layers = args.drafter_layers or (2 if args.tiny else 5)
    new_tokens = args.new_tokens or (48 if args.tiny else 128)
    iters = args.iters or (5 if args.tiny else 20)
    if args.attn:
        backends = [a.strip() for a in args.attn.split(",") if a.strip()]
    else:
        backends = ["sdpa"]
        try:
            import flash_attn  # noqa: F401

            if device.type == "cuda":
                backends.append("flash_attention_2")
        except ImportError:
            pass

    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": "tiny" if args.tiny else "Qwen3-8B",
        "drafter_layers": drafter_layers,
        "block_size": args.block_size,
        "tau": args.tau,
        "new_tokens": new_tokens,
    }
    print(f"# DFlash per-step overhead ({env['shape']} target, random weights)\n")
    print(", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    start = time.perf_counter()
    target, drafter = build_models(shape, drafter_layers, args.block_size, dtype, device, backends[0])
    print(f"built the models in {time.perf_counter() - start:.1f} s", flush=True)

    results = []
    for attn in backends:
        try:
            set_attention(target, drafter, attn)
        except Exception as error:  # noqa: BLE001 - e.g. flash_attn missing or unsupported dtype
            print(f"skipping {attn}: {type(error).__name__}: {error}", flush=True)
            continue
        for context in contexts:
            t0 = time.perf_counter()
            kernels = forward_timings(target, drafter, context, args.block_size, args.tau, iters, device)
            gen = generate_timings(
                target, drafter, context, new_tokens, args.tau, args.runs, device, args.torch_profile
            )
            row = {"attn": attn, "context": context, **kernels, **gen}
            results.append(row)
            print(f"{attn} C={context}: done in {time.perf_counter() - t0:.1f} s", flush=True)

    print()
    print(
        "| attention | context | verify 1 tok (ms) | verify block (ms) | drafter fwd (ms) | plain ms/token | "
        "DFlash step (ms) | tau (emulated) | r = step/plain | speedup (decode) | speedup (e2e) | greedy = plain |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        equal = "yes" if r["outputs_equal"] else f"from token {r['first_difference']} on, no"
        print(
            f"| {r['attn']} | {r['context']} | {r['verify_1_ms']:.2f} | {r['verify_block_ms']:.2f} | "
            f"{r['draft_tau_ms']:.2f} | {r['plain_ms_per_token']:.2f} | {r['dflash_step_ms']:.2f} | "
            f"{r['tau_emulated']:.2f} | {r['r']:.2f} | {r['speedup_decode_only']:.2f}x | "
            f"{r['speedup_end_to_end']:.2f}x | "
            f"{equal} |"
        )
    print()
    print("Kernel-level bound: r_min = (verify block + drafter fwd) / verify 1 tok, i.e. without any overhead:")
    for r in results:
        r["r_kernels"] = (r["verify_block_ms"] + r["draft_tau_ms"]) / r["verify_1_ms"]
        print(
            f"- {r['attn']} C={r['context']}: r_min = {r['r_kernels']:.2f}, r measured = {r['r']:.2f}, implied "
            f"speedup at tau {args.tau:g}: {args.tau / r['r']:.2f}x"
        )
    print()
    print("Where a DFlash step goes (ms per step; separate run with a device sync at every boundary):\n")
    print("| attention | context | draft | verify | cache crop | accept/commit | other (Python) | step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        b = r["breakdown"]
        print(
            f"| {r['attn']} | {r['context']} | {b['draft_ms']:.2f} | {b['verify_ms']:.2f} | "
            f"{b['cache_crop_ms']:.3f} | {b['accept_commit_ms']:.3f} | {b['other_ms']:.2f} | {b['step_ms']:.2f} |"
        )
    for r in results:
        if "torch_profile" in r:
            print(f"\ntorch.profiler, {r['attn']} C={r['context']}:\n{r['torch_profile']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
