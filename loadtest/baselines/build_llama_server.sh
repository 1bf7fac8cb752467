#!/usr/bin/env bash
# Builds llama.cpp's llama-server (and llama-bench, llama-quantize, llama-perplexity) once, from the llama.cpp vendored in the llama-cpp-python
# sdist on PyPI, into a cache outside the repo (not part of CI: about 25-40 min on 2 cores).
#
#   bash loadtest/baselines/build_llama_server.sh      # prints the binary's path when done
#
# LLAMA_CPP_CACHE (default ~/.cache/pdserve/llama.cpp) holds the sdist, the build and the
# binary; a second run finds the binary and returns at once. LLAMA_CPP_PYTHON_VERSION pins
# the sdist (default: the newest). The build is native (-DGGML_NATIVE=ON), as a user who
# builds llama.cpp on their own machine gets it.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache="${LLAMA_CPP_CACHE:-$HOME/.cache/pdserve/llama.cpp}"
binary="$cache/bin/llama-server"
if [[ -x "$binary" && -x "$cache/bin/llama-quantize" && -x "$cache/bin/llama-perplexity" ]]; then
  echo "$binary"
  exit 0
fi
mkdir -p "$cache/sdist"
python="${PYTHON:-.venv/bin/python}"
spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
if ! ls "$cache"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$python" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
    "$spec" -d "$cache/sdist"
fi
sdist=$(ls "$cache"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)
src="$cache/src"
rm -rf "$src"
mkdir -p "$src"
tar -xzf "$sdist" -C "$src" --strip-components=1
llama="$src/vendor/llama.cpp"
[[ -f "$llama/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $sdist" >&2; exit 1; }

jobs="${JOBS:-$(nproc)}"
cmake -S "$llama" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >"$cache/cmake.log"
# llama-bench too: llama.cpp's own single-stream decode figure (tg) on the same file;
# llama-quantize makes the K-quant files (loadtest/baselines/make_kquants.sh) and
# llama-perplexity is the reference for their quality.
cmake --build "$cache/build" --target llama-server llama-bench llama-quantize llama-perplexity \
  -j "$jobs" >"$cache/build.log"
mkdir -p "$cache/bin"
for tool in llama-bench llama-quantize llama-perplexity; do
  cp "$cache/build/bin/$tool" "$cache/bin/$tool"
done
cp "$cache/build/bin/llama-server" "$binary"
echo "$(basename "$sdist") -> $binary" >"$cache/bin/VERSION"
echo "$binary"
