#!/usr/bin/env bash
# Install llama-cpp-python into a venv from a wheel built with exactly these CMake arguments.
#
# pip's own wheel cache keys a built wheel by the sdist alone, not by CMAKE_ARGS, so a wheel built once with other
# arguments (a native build on another CPU, a build without RPC) would come back silently. This script keeps its
# own wheelhouse, one folder per (version, CMake arguments, machine architecture), and never lets pip's cache in.
#
# usage: install-llama-cpp.sh VENV_PYTHON VERSION CMAKE_ARGS
set -euo pipefail
py=$1 version=$2 cmake_args=$3

key=$(printf 'llama-cpp-python==%s\n%s\n%s\n' "$version" "$cmake_args" "$(uname -m)" | sha256sum | cut -c1-16)
house="${KVPOOL_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/wheels}/$key"

if ! ls "$house"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
  echo "Building llama-cpp-python $version with CMAKE_ARGS='$cmake_args' (about 10 minutes on 2 cores, once)"
  mkdir -p "$house.tmp"
  CMAKE_ARGS="$cmake_args" "$py" -m pip wheel --quiet --no-cache-dir --no-deps \
    --no-binary llama-cpp-python -w "$house.tmp" "llama-cpp-python==$version"
  printf '%s\n' "$cmake_args" >"$house.tmp/CMAKE_ARGS"
  rm -rf "$house" && mv "$house.tmp" "$house"
fi
wheel=$(ls "$house"/llama_cpp_python-"$version"-*.whl)
"$py" -m pip install --quiet --no-cache-dir --force-reinstall --no-deps "$wheel"
"$py" -m pip install --quiet "$wheel"  # its dependencies (numpy, jinja2, ...), which may come from pip's cache
