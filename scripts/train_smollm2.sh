#!/usr/bin/env bash
# How the shipped SmolLM2-135M-Instruct drafter was made (src/transformers_dflash/drafters/smollm2-135m-instruct).
# Every step resumes where it stopped: rerun the same command after an interruption.
# Usage: bash scripts/train_smollm2.sh [DATA_ROOT]   (default /work/data; needs the package installed with [train,demo])
set -euo pipefail
root=${1:-/work/data}
threads=${THREADS:-1}
# 1. The target answers the training prompts itself (greedy, 256 new tokens at most).
dflash regenerate --target smollm2 --out "$root/smollm2-train" --batch-size 64 --threads "$threads" \
  --max-shards "${MAX_SHARDS:-4}"
# 2. Cache the target's hidden states of the five default layers (offline training skips the target).
dflash features --target smollm2 --data "$root/smollm2-train" --out "$root/smollm2-features" --max-length 1024 \
  --threads "$threads"
# 3. Train: 2 layers, block 8, 8192-token draft vocabulary, 64 anchors per sequence; cross-entropy alone, as the
#    shipped drafter was trained (KL=0.5 to the target's top tokens, the default since, gained +0.009 tau: set KL=0.5).
dflash train --target smollm2 --data "$root/smollm2-features" --output "$root/smollm2-drafter" \
  --kl-weight "${KL:-0}" \
  --num-layers 2 --block-size 8 --mask-token-id 16 --draft-vocab-size 8192 --num-anchors 64 --max-length 1024 \
  --batch-size 8 --lr 8e-4 --warmup-ratio 0.03 --max-steps "${MAX_STEPS:-1200}" --save-every 25 \
  --keep-checkpoints 2 --eval-every 100000 --num-val-prompts 4 --val-max-new-tokens 64 --log-every 5
