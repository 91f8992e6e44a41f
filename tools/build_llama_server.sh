#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, `llama-quantize` and `llama-perplexity` (CPU) from the sources vendored in the
# llama-cpp-python==0.3.36 sdist, taken from pip's configured index, once, into a cache outside the repo; print
# llama-server's path (the others sit beside it).
#   tools/build_llama_server.sh            # ~10-20 min on two cores the first time, then instant
# Env: LLAMA_CACHE_DIR (default ~/.cache/octavo/llama.cpp), PYTHON (default python3), JOBS (default nproc).
set -euo pipefail
VERSION=0.3.36
CACHE=${LLAMA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/octavo/llama.cpp}
PYTHON=${PYTHON:-python3}
BIN="$CACHE/build-$VERSION/bin/llama-server"
# (a cache built before llama-quantize / llama-perplexity were added here is built again: incremental)
if [[ -x "$BIN" && -x "$(dirname "$BIN")/llama-quantize" && -x "$(dirname "$BIN")/llama-perplexity" ]]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$CACHE"
cd "$CACHE"
if [[ ! -d "llama_cpp_python-$VERSION" ]]; then
  # The sdist's URL from the simple index pip is configured with (PIP_INDEX_URL, pip.conf; else PyPI's):
  # `pip download` would try to build the sdist's metadata, which needs the whole CMake build.
  index=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.index-url='\(.*\)'$/\1/p" | head -1)
  index=${PIP_INDEX_URL:-${index:-https://pypi.org/simple}}
  page=$(curl -fsSL "${index%/}/llama-cpp-python/")
  url=$(grep -o "href=\"[^\"#]*llama_cpp_python-$VERSION.tar.gz" <<<"$page" | head -1 | sed 's/^href="//')
  [[ -n "$url" ]] || { echo "llama-cpp-python $VERSION's sdist is not in the index $index" >&2; exit 1; }
  [[ "$url" == http* ]] || url="${index%/}/llama-cpp-python/$url"  # a relative link
  mkdir -p sdist && curl -fsSL -o "sdist/llama_cpp_python-$VERSION.tar.gz" "$url"
  tar -xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"
# GGML_NATIVE: use this CPU's vector units (as Octavo's kernels do); no curl: nothing is downloaded.
# AMX off: on the project's Intel machines that expose AMX, the native build's AMX kernel dies of
# SIGILL (the tiles are listed but not usable); the compiler's explicit -mno-amx-* win over
# -march=native, so the rest of the native build (AVX-512, VNNI) stays.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC" -B "build-$VERSION" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
# llama-perplexity: the accuracy figure beside `octavo eval`'s (tools/compare_llama_cpp.sh PERPLEXITY=1).
# llama-quantize too: benchmark files of real shapes are written with random weights and quantized by it
cmake --build "build-$VERSION" --target llama-server llama-quantize llama-perplexity -j "${JOBS:-$(nproc)}" >&2
echo "$BIN"
