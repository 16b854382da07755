#!/usr/bin/env bash
# The long regeneration for the SmolLM2-135M-Instruct drafter (issue 13): ~34K training prompts (ShareGPT first turns
# + composed prompts) answered by the target, greedy, 256 new tokens at most, in the background at the lowest
# priority. Rerun the same command after an interruption: finished shards are kept (it resumes).
#
# Usage: bash scripts/regenerate_smollm2.sh   (starts it in the background, prints the PID; the first llamacpp start
#   waits for llama-server to build)
# Settings (environment): ENGINE (transformers, llamacpp or ctranslate2; default: transformers on a CPU with AMX or
#   AVX512-BF16, else llamacpp), OUT, LOG, PYTHON, THREADS, COMPUTE_TYPE, NUM_COMPOSED,
#   SHARD_SIZE (prompts per shard: the unit of resuming, so an interruption loses at most one shard's answers; 64, and
#   512 for the transformers engine, whose batches are length buckets within a shard),
#   SKIP_PROMPTS (leave out the first N prompts: another run answered them), PORT (llama.cpp's server),
#   FEATURES (a folder: run `dflash features --follow` on the shards as they land, log in $FEATURES.log; on 2 cores
#   it slowed llama.cpp several-fold, docs/training.md, so there run `dflash features` on finished shards instead).
# Progress: one line per finished shard in $LOG, and $OUT/manifest.json (shards_done, totals).
#
# Engines (docs/data-engines.md): transformers = the target's generate() in bfloat16, batches of up to 64 prompts of
# similar length, with a KV cache that does not copy itself at every step: 353 response tokens/s on a 2-core AMX Xeon,
# where llama.cpp's server (built without AMX, scripts/llama_server_smollm2.sh) gave 144, and 259 on a 2-core EPYC with
# AVX512-BF16, where it gave 179; on CPUs with neither, bfloat16 is emulated and slow.
# llamacpp = llama.cpp's server on the target's Q4_1 GGUF
# (scripts/llama_server_smollm2.sh, started here when it is not running), measured 2.5-2.9x CTranslate2 float32 on
# this CPU; its tokens are the target's own choice 98 % of the time and `dflash train`'s target labels mend the rest.
# ctranslate2 = the target's exact greedy answers (float32), slower.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-/work/main/.venv-tf5.24.0/bin/python}
if [ -z "${ENGINE:-}" ]; then
  engine=llamacpp
  PYTHONPATH="$repo/src" "$python" -c "import sys; from transformers_dflash.kernels import bfloat16_is_fast; \
sys.exit(not bfloat16_is_fast('cpu'))" && engine=transformers
else
  engine=$ENGINE
fi
# Under the package's cache (as the converted target and llama-server are), not under /work: on this project's
# machines the home folder has outlived a fresh checkout of /work once (two sessions' shards had been lost with
# /work), though a new machine starts with neither (2026-12-03).
out=${OUT:-${DFLASH_CACHE:-$HOME/.cache/transformers_dflash}/data/regen-$engine}
log=${LOG:-$out.log}
threads=${THREADS:-2}
port=${PORT:-8080}
# 26000 composed + ~8.1K ShareGPT prompts = 33909 training prompts after dedupe and the validation hold-out.
num_composed=${NUM_COMPOSED:-26000}
skip=${SKIP_PROMPTS:-0}
# Shards of 256 took hours at nice 19 beside other work, and a session that ended 1 answer short of a shard lost 255.
default_shard_size=64
[ "$engine" = transformers ] && default_shard_size=512
shard_size=${SHARD_SIZE:-$default_shard_size}
mkdir -p "$(dirname "$log")"
cd "$repo"
export HF_HUB_OFFLINE=1 PYTHONPATH="$repo/src"
common=(--target smollm2 --prompts train --num-composed "$num_composed" --skip-prompts "$skip" --out "$out"
  --max-new-tokens 256 --shard-size "$shard_size" --no-progress)
case "$engine" in
  llamacpp)
    url="http://127.0.0.1:$port"
    server_answers() { "$python" -c "import urllib.request; urllib.request.urlopen('$url/v1/models', timeout=5)" 2>/dev/null; }
    if ! server_answers; then
      PORT=$port THREADS=$threads PYTHON=$python nohup nice -n 19 bash scripts/llama_server_smollm2.sh \
        >>"$out.server.log" 2>&1 &
      server=$!
      # the first start builds llama-server (minutes); wait until it answers, or stop if it failed
      until server_answers; do
        kill -0 "$server" 2>/dev/null || { echo "llama-server did not start: see $out.server.log" >&2; exit 1; }
        sleep 10
      done
    fi
    # At nice 19 beside other work a request of 256 tokens can wait far longer than the default 600 s.
    nohup nice -n 19 "$python" -m transformers_dflash.cli regenerate "${common[@]}" \
      --engine openai --server-url "$url" --concurrency 16 --request-timeout 3600 >>"$log" 2>&1 &
    ;;
  transformers)
    # bfloat16: on a CPU with AMX or AVX512-BF16 several times float32 (docs/data-engines.md); `dflash train`'s target
    # labels mend the tokens where its answers leave the float32 target's greedy path.
    nohup nice -n 19 "$python" -m transformers_dflash.cli regenerate "${common[@]}" \
      --engine transformers --dtype bfloat16 --batch-size 64 --threads "$threads" >>"$log" 2>&1 &
    ;;
  ctranslate2)
    # float32: measured (scripts/bench_engines.py) to give the target's own greedy answers far more often than int8.
    nohup nice -n 19 "$python" -m transformers_dflash.cli regenerate "${common[@]}" \
      --engine ctranslate2 --compute-type "${COMPUTE_TYPE:-float32}" --batch-size 32 --threads "$threads" >>"$log" 2>&1 &
    ;;
  *) echo "ENGINE=$engine: use transformers, llamacpp or ctranslate2" >&2; exit 2 ;;
esac
regeneration=$!
echo "$regeneration"
# FEATURES=DIR: also cache the target's features of each shard as it lands (`dflash features --follow`), beside it.
if [ -n "${FEATURES:-}" ]; then
  # --follow reads the regeneration's manifest, which a new run writes only once its prompts are ready (minutes on
  # a busy machine): wait for it, or stop if the regeneration died first.
  until [ -f "$out/manifest.json" ]; do
    kill -0 "$regeneration" 2>/dev/null || { echo "the regeneration stopped before writing its manifest: see $log" >&2; exit 1; }
    sleep 5
  done
  nohup nice -n 19 "$python" -m transformers_dflash.cli features --target smollm2 --data "$out" --out "$FEATURES" \
    --max-length 1024 --threads "$threads" --follow >>"$FEATURES.log" 2>&1 &
  echo "$!"
fi
