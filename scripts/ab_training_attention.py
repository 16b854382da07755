"""A/B: the training step's attention dense (one masked call over all keys) against grouped by blocks
(`transformers_dflash.training.packed_attention`), side by side in one process.

Times `dflash_loss` forward + backward (the whole training step but the optimizer update) of the shipped SmolLM2
drafter on batches of cached features at the CPU recipe's shapes (batch 8, 64 anchors, sequences up to 1024 tokens),
the variants in a shuffled order on every batch of every round, and checks that the losses and a gradient are equal.
Prints each variant's median seconds and its per-batch ratio to dense (median and range).

    python scripts/ab_training_attention.py --features ~/.cache/transformers_dflash/data/regen-llamacpp-f \
        --threads 1 --rounds 5
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

DRAFTER = REPO / "src" / "transformers_dflash" / "drafters" / "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="a `dflash features` folder of the SmolLM2 target")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3, help="batches of 8 sequences, from the first shards")
    parser.add_argument("--rows-per-group", type=int, nargs="+", default=[128], help="grouped variants to time")
    args = parser.parse_args()

    from transformers_dflash import DFlashDraftModel
    from transformers_dflash.smollm2 import load_smollm2
    from transformers_dflash.training import collate, dflash_loss, iter_training_examples, packed_attention

    torch.set_num_threads(args.threads)
    target, _ = load_smollm2(dtype=torch.float32)
    target.requires_grad_(False)
    drafter = DFlashDraftModel.from_pretrained(DRAFTER, dtype=torch.float32).train()
    drafter.config._attn_implementation = "sdpa"  # as `dflash train` sets it
    examples = iter_training_examples(args.features)
    batches = [collate([next(examples) for _ in range(8)], 1024) for _ in range(args.batches)]
    print("batch shapes:", [tuple(b["input_ids"].shape) for b in batches])
    variants = {"dense": 10**9, **{f"grouped-{n}": n for n in args.rows_per_group}}

    def step(variant, batch, seed):
        packed_attention.ROWS_PER_GROUP = variants[variant]
        drafter.zero_grad()
        start = time.perf_counter()
        loss, _ = dflash_loss(
            drafter, target, batch["input_ids"], batch["loss_mask"], 64,
            attention_mask=batch["attention_mask"], context_features=batch["context_features"],
            generator=torch.Generator().manual_seed(seed), target_ids=batch.get("target_ids"),
            target_top_ids=batch.get("target_top_ids"), target_top_logprobs=batch.get("target_top_logprobs"),
            kl_weight=0.5 if batch.get("target_top_ids") is not None else 0.0,
        )  # fmt: skip
        loss.backward()
        return time.perf_counter() - start, loss.item(), drafter.fc.weight.grad.norm().item()

    for variant in variants:
        step(variant, batches[0], 0)  # warm-up
    seconds = {variant: [] for variant in variants}
    results = {}
    for round_index in range(args.rounds):
        for i, batch in enumerate(batches):
            order = list(variants)
            random.Random(round_index * 100 + i).shuffle(order)
            for variant in order:
                elapsed, loss, grad_norm = step(variant, batch, i)
                seconds[variant].append(elapsed)
                results.setdefault(i, {})[variant] = (loss, grad_norm)
    for i, by_variant in results.items():
        dense = by_variant["dense"]
        for variant, values in by_variant.items():
            if abs(values[0] - dense[0]) > 1e-4 * abs(dense[0]) or abs(values[1] - dense[1]) > 1e-4 * abs(dense[1]):
                raise SystemExit(f"batch {i}: {variant} gave loss / grad norm {values}, dense {dense}")
    print(f"{args.threads} thread(s), {args.rounds} rounds x {len(batches)} batches; losses and gradients equal")
    for variant, times in seconds.items():
        ratios = sorted(t / d for t, d in zip(times, seconds["dense"]))
        print(
            f"{variant:>14}: {statistics.median(times):.3f} s per step (median; {min(times):.3f}-{max(times):.3f}), "
            f"vs dense {statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


if __name__ == "__main__":
    main()
