#!/usr/bin/env bash
# The long regeneration for the SmolLM2-135M-Instruct drafter (issue 13): ~34K training prompts (ShareGPT first turns
# + composed prompts) answered by the target through CTranslate2, greedy, 256 new tokens at most, in the background at
# the lowest priority. Rerun the same command after an interruption: finished shards are kept (it resumes).
#
# Usage: bash scripts/regenerate_smollm2.sh            (starts it in the background, prints the PID)
# Settings (environment): OUT, LOG, PYTHON, THREADS, COMPUTE_TYPE, NUM_COMPOSED.
# Progress: one line per finished shard (256 prompts) in $LOG, and $OUT/manifest.json (shards_done, totals).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/work/dflash-data/regen-v2}
log=${LOG:-/work/dflash-data/regen-v2.log}
python=${PYTHON:-/work/main/.venv-tf5.24.0/bin/python}
threads=${THREADS:-2}
# float32: measured (scripts/bench_engines.py) to give the target's own greedy answers far more often than int8.
compute_type=${COMPUTE_TYPE:-float32}
# 26000 composed + ~8.1K ShareGPT prompts = 33909 training prompts after dedupe and the validation hold-out.
num_composed=${NUM_COMPOSED:-26000}
mkdir -p "$(dirname "$log")"
cd "$repo"
HF_HUB_OFFLINE=1 PYTHONPATH="$repo/src" nohup nice -n 19 "$python" -m transformers_dflash.cli regenerate \
  --target smollm2 --prompts train --num-composed "$num_composed" --out "$out" \
  --engine ctranslate2 --compute-type "$compute_type" --batch-size 32 --threads "$threads" \
  --max-new-tokens 256 --shard-size 256 --no-progress >>"$log" 2>&1 &
echo "$!"
