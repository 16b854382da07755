"""Per-step cost of DFlash's recurrent-state rollback on a tiny hybrid target, next to an attention-only target of
the same size (docs/hybrid.md). Not a test: timings on a shared machine, printed as median [min-max] over repeats
that interleave the two targets.

    PYTHONPATH=src python scripts/bench_hybrid_rollback.py [--repeats 7] [--block 8] [--prompt 128] [--threads 1]

Targets (float32, random weights, CPU): `qwen3` (every layer full attention) and `qwen3_5_text` (3 Gated DeltaNet
layers per full-attention layer, transformers' PyTorch kernels) with the same hidden size, depth, heads and MLP. Per
step of a prefilled prompt it times:
- `verify`: the target forward over [anchor + block-1 drafts] (what every DFlash step pays);
- `snapshot`: copying the recurrent and conv state before it (hybrid only);
- `rollback`: restoring that copy and re-feeding k kept tokens (hybrid only; k = 1: every draft rejected; k = block/2);
- `decode`: one plain one-token decoding step (what plain generate() pays per token);
- `dflash step`: whole `generate(assistant_model=untrained drafter)` steps (every draft rejected), wall time / steps.
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

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, bos_token_id=1, eos_token_id=None,
             pad_token_id=0)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
              linear_num_value_heads=8)


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
def measure(target, block, prompt_len, inner=5):
    keyword = cache_keyword(target)
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = new_target_cache(target, {}, target.generation_config)
    target(input_ids=prompt, use_cache=True, **{keyword: cache})
    rollback = StateRollback.for_target(target, cache)
    ops = rollback if rollback is not None else cache
    block_ids = torch.randint(3, SHAPE["vocab_size"], (1, block), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(prompt_len, prompt_len + block)[None]

    def forward(ids, pos):
        target(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=ids.shape[1], **{keyword: cache})

    def verify():
        forward(block_ids, positions)
        ops.crop(-block)

    def decode():
        forward(block_ids[:, :1], positions[:, :1])
        ops.crop(-1)

    result = {"verify": timed(verify, inner), "decode": timed(decode, inner)}
    if rollback is not None:
        rollback.snapshot()
        result["snapshot"] = timed(rollback.snapshot, inner * 4)
        for kept in (1, block // 2):
            def roll(kept=kept):
                rollback.restore()
                forward(block_ids[:, :kept], positions[:, :kept])
                ops.crop(-kept)
            result[f"rollback k={kept}"] = timed(roll, inner)
    return result


def dflash_step(target, block, prompt_len, new_tokens=24):
    torch.manual_seed(3)
    drafter = DFlashDraftModel.from_target(target, num_layers=1, block_size=block).eval()
    drafter.draft_length, drafter.ngram_lookup = "full", 0
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
    seconds = time.perf_counter() - start
    return seconds / (len(drafter.last_acceptance_lengths) - 1) * 1e3  # minus the prefill "step"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets = {"attention": build("qwen3"), "hybrid": build("qwen3_5_text")}
    for target in targets.values():  # warm-up (kernel selection, allocator)
        measure(target, args.block, args.prompt, inner=1)
    samples = {name: {} for name in targets}
    for _ in range(args.repeats):
        for name, target in targets.items():  # interleaved, so load changes hit both alike
            for key, value in measure(target, args.block, args.prompt).items():
                samples[name].setdefault(key, []).append(value)
            samples[name].setdefault("dflash step", []).append(dflash_step(target, args.block, args.prompt))

    def show(values):
        return f"{statistics.median(values):7.2f} [{min(values):.2f}-{max(values):.2f}]"

    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} thread(s), "
          f"prompt {args.prompt}, block {args.block}, {args.repeats} repeats; ms, median [min-max]")
    print(f"{'':22s} {'attention-only':>24s} {'hybrid':>24s} {'ratio':>7s}")
    keys = ["decode", "verify", "snapshot", "rollback k=1", f"rollback k={args.block // 2}", "dflash step"]
    for key in keys:
        a, h = samples["attention"].get(key), samples["hybrid"].get(key)
        ratio = f"{statistics.median(h) / statistics.median(a):6.2f}x" if a and h else ""
        print(f"{key:22s} {show(a) if a else '-':>24s} {show(h) if h else '-':>24s} {ratio:>7s}")
    h = samples["hybrid"]
    overhead = statistics.median(h["snapshot"]) + statistics.median(h["rollback k=1"])
    print(f"hybrid rollback per rejecting step (snapshot + rollback k=1) / hybrid verify: "
          f"{overhead / statistics.median(h['verify']):.2f}")


if __name__ == "__main__":
    main()
