#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the llama.cpp that llama-cpp-python vendors (its PyPI sdist), with the
# CMake arguments kvpool's llama-cpp-python is built with: the anchor bench/ compares kvpool against, on the same
# kernels. Nothing is fetched but the sdist; the web UI is not built (no download from a hub). Cached per version,
# arguments and architecture, like scripts/install-llama-cpp.sh.
#
# usage: build-llama-server.sh VERSION CMAKE_ARGS   (prints the path of the llama-server binary)
#        KVPOOL_FIND_ONLY=1 build-llama-server.sh ...   (only finds a binary built before; exit 1 if there is none)
set -euo pipefail
version=$1 cmake_args=$2
key=$(printf 'llama-server %s\n%s\n%s\n' "$version" "$cmake_args" "$(uname -m)" | sha256sum | cut -c1-16)
home="${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/llama-server/$key"
binary="$home/bin/llama-server"
if [ ! -x "$binary" ] && [ -n "${KVPOOL_FIND_ONLY:-}" ]; then
  exit 1
fi
if [ ! -x "$binary" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
  tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
  src="$work/llama_cpp_python-$version/vendor/llama.cpp"
  # shellcheck disable=SC2086  # the CMake arguments are words
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $cmake_args -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2
  mkdir -p "$home/bin"
  cp "$work/build/bin/llama-server" "$binary.tmp" && mv "$binary.tmp" "$binary"
fi
echo "$binary"
