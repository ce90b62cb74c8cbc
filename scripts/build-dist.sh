#!/usr/bin/env bash
# Build kvpool's sdist, then its wheel from that sdist (python -m build), so the wheel holds exactly what a source
# release can rebuild. Nothing left over from an earlier build (build/, *.egg-info) can reach the wheel.
#
# usage: build-dist.sh PYTHON OUTDIR   (PYTHON: a venv with build, setuptools>=77 and wheel)
set -euo pipefail
py=$1 out=$2
cd "$(dirname "$0")/.."
rm -rf "$out" build ./*.egg-info
"$py" -m build --no-isolation --outdir "$out" . >"${TMPDIR:-/tmp}/kvpool-build-dist.log" 2>&1 \
  || { cat "${TMPDIR:-/tmp}/kvpool-build-dist.log" >&2; exit 1; }
rm -rf build ./*.egg-info
ls "$out"/kvpool-*.tar.gz "$out"/kvpool-*-py3-none-any.whl
