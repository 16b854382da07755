"""Per-step cost of DFlash's recurrent-state rollback on a tiny hybrid target, next to an attention-only target of
the same size (docs/hybrid.md). Not a test: timings on a shared machine, printed as median [min-max] over repeats
that interleave the two targets.

    PYTHONPATH=src python scripts/bench_hybrid_rollback.py [--repeats 7] [--inner 5] [--block 8] [--prompt 128]

Targets (float32, random weights, CPU): `qwen3` (every layer full attention) and `qwen3_5_text` (3 Gated DeltaNet
layers per full-attention layer, transformers' PyTorch kernels) with the same hidden size, depth, heads and MLP. Per
step of a prefilled prompt it times:
- `verify`: the target forward over [anchor + block-1 drafts] (what every DFlash step pays);
- `snapshot`: copying the recurrent and conv state before it (hybrid only);
- `rollback`: restoring that copy and re-feeding k kept tokens (hybrid only; k = 1: every draft rejected; k = block/2);
- `decode`: one plain one-token decoding step (what plain generate() pays per token);
- `dflash step`: whole `generate(assistant_model=untrained drafter)` steps (every draft rejected), wall time / steps;
- `plain 64` / `defaults 64`: a whole `generate()` of 64 new tokens, plain and with the untrained drafter at its
  defaults (`draft_length` "auto" on CPUs, which must learn that drafting does not pay: on the hybrid a rejected
  block also costs the re-feed). Their ratio is the last line.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import transformers_dflash  # noqa: F401
from transformers_dflash import DFlashDraftModel
from transformers_dflash.state_rollback import StateRollback
from transformers_dflash.target_model import cache_keyword, new_target_cache

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
)


def build(model_type):
    extra = LINEAR if model_type == "qwen3_5_text" else {}
    config = AutoConfig.for_model(model_type, **SHAPE, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def timed(fn, inner):
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner * 1e3  # ms


@torch.no_grad()
def operations(target, block, prompt_len):
    """The timed operations of one prefilled target, as callables that leave the cache as they found it."""
    keyword = cache_keyword(target)
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = new_target_cache(target, {}, target.generation_config)
    target(input_ids=prompt, use_cache=True, **{keyword: cache})
    rollback = StateRollback.for_target(target, cache)
    ops = rollback if rollback is not None else cache
    block_ids = torch.randint(3, SHAPE["vocab_size"], (1, block), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(prompt_len, prompt_len + block)[None]

    @torch.no_grad()
    def forward(width):
        target(
            input_ids=block_ids[:, :width],
            position_ids=positions[:, :width],
            use_cache=True,
            logits_to_keep=width,
            **{keyword: cache},
        )
        ops.crop(-width)  # attention back to the prompt (the recurrent state moves on: timing is unaffected)

    result = {"decode": lambda: forward(1), "verify": lambda: forward(block)}
    if rollback is not None:
        rollback.snapshot()
        result["snapshot"] = rollback.snapshot
        for kept in (1, block // 2):
            result[f"rollback k={kept}"] = lambda kept=kept: (rollback.restore(), forward(kept))
    torch.manual_seed(3)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=block).eval()
    drafter.draft_length, drafter.ngram_lookup = "full", 0

    defaults = DFlashDraftModel.from_target(target, num_layers=1, block_size=block).eval()  # draft_length etc. unset
    result["plain 64"] = lambda: target.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    result["defaults 64"] = lambda: target.generate(
        prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, assistant_model=defaults
    )

    def dflash_step(new_tokens=16):
        start = time.perf_counter()
        target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        steps = len(drafter.last_acceptance_lengths) - 1  # minus the prefill
        return (time.perf_counter() - start) / steps * 1e3

    return result, dflash_step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setups = {
        name: operations(build(model_type), args.block, args.prompt)
        for name, model_type in (("attention", "qwen3"), ("hybrid", "qwen3_5_text"))
    }
    keys = ["decode", "verify", "snapshot", "rollback k=1", f"rollback k={args.block // 2}", "dflash step"]
    keys += ["plain 64", "defaults 64"]
    samples = {name: {key: [] for key in keys} for name in setups}
    for ops, step in setups.values():  # warm-up (kernel selection, allocator)
        for fn in ops.values():
            fn()
        step()
    for _ in range(args.repeats):
        for key in keys:  # each operation on both targets back to back, so load changes hit both alike
            for name, (ops, step) in setups.items():
                if key == "dflash step":
                    samples[name][key].append(step())
                elif key in ops:
                    samples[name][key].append(timed(ops[key], 1 if key.endswith(" 64") else args.inner))

    def show(values):
        return f"{statistics.median(values):7.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "-"

    import transformers

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} thread(s), "
        f"prompt {args.prompt}, block {args.block}, {args.repeats} repeats x {args.inner}; "
        "ms, median [min-max]; ratio = hybrid / attention-only, per repeat"
    )
    print(f"{'':16s} {'attention-only':>22s} {'hybrid':>22s} {'ratio':>22s}")
    for key in keys:
        a, h = samples["attention"][key], samples["hybrid"][key]
        ratios = [y / x for x, y in zip(a, h)] if a and h else []
        print(f"{key:16s} {show(a):>22s} {show(h):>22s} {show(ratios):>22s}")
    h = samples["hybrid"]
    shares = [(s + r) / v for s, r, v in zip(h["snapshot"], h["rollback k=1"], h["verify"])]
    print(f"hybrid: (snapshot + rollback k=1) / verify, per repeat: {show(shares)}")
    for name, target_samples in samples.items():
        speed = [p / d for p, d in zip(target_samples["plain 64"], target_samples["defaults 64"])]
        print(f"{name}: speed at the drafter's defaults / plain generate(), per repeat: {show(speed)}")


if __name__ == "__main__":
    main()
