#!/usr/bin/env bash
# llama.cpp's server on the GGUF that SmolLM2-135M-Instruct ships as, for `dflash regenerate --engine openai`
# (docs/data-engines.md). Builds llama-server once from the llama.cpp sources vendored in llama-cpp-python's sdist
# (PyPI; about 13 minutes on 2 cores), then serves on 127.0.0.1:$PORT in the foreground.
#
# Usage: bash scripts/llama_server_smollm2.sh    then, in another shell:
#   dflash regenerate --target smollm2 --out OUT --engine openai --server-url http://127.0.0.1:8080 --concurrency 16
# Settings (environment): BUILD (where the build goes; default $DFLASH_CACHE/llama.cpp, as for the other caches),
#   PORT, THREADS, SLOTS (sequences decoded together), PYTHON, CACHE_RAM (MiB for llama-server's prompt cache; 0,
#   the default here, turns it off: every prompt of a regeneration is new, and llama-server's own default of 8 GiB
#   grew its memory from 1.4 to 7.9 GiB within two hours).
set -euo pipefail
build=${BUILD:-${DFLASH_CACHE:-$HOME/.cache/transformers_dflash}/llama.cpp}
port=${PORT:-8080}
threads=${THREADS:-2}
slots=${SLOTS:-16}
cache_ram=${CACHE_RAM:-0}
python=${PYTHON:-python}
version=0.3.36  # llama-cpp-python, whose sdist carries llama.cpp's sources
server="$build/build/bin/llama-server"
if [ ! -x "$server" ]; then
  mkdir -p "$build"
  "$python" -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$build"
  tar xzf "$build/llama_cpp_python-$version.tar.gz" -C "$build"
  # Without AMX: on an Intel Xeon that reports AMX, llama-server built with -march=native (ggml's default) crashed
  # in ggml_backend_amx_mul_mat while loading the model (2026-12-03). Explicit -mno-* flags win over -march=native.
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$build/llama_cpp_python-$version/vendor/llama.cpp" -B "$build/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx"
  cmake --build "$build/build" --target llama-server -j "$threads"
fi
gguf=$("$python" -c "from transformers_dflash.smollm2 import find_smollm2_gguf; print(find_smollm2_gguf())")
# One context of 2,048 tokens per slot: the longest training prompt (1,024 tokens kept) plus 256 new tokens fits.
exec "$server" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$threads" -tb "$threads" -np "$slots" \
  -c $((slots * 2048)) --cache-ram "$cache_ram" --no-webui
