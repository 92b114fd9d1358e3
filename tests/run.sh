#!/usr/bin/env bash
# Runs every test of fusedmha: builds the library, the Python extension (in
# place, into python/fusedmha/) and the GoogleTest suite with CMake, then runs
# ctest and pytest against that build. The build tree is the one
# `pip install .` builds the package in (build/release): what the install
# compiled is not compiled again.
#
#   bash tests/run.sh [pytest args]
#
# Then the same again under ASan + UBSan (tests/sanitize.sh; skipped with
# FUSEDMHA_SANITIZE_RUN=0). Installs what is missing first (tests/install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source tests/stages.sh
stage "install test dependencies"
bash tests/install_deps.sh
build="${FUSEDMHA_BUILD_DIR:-$root/build/release}"
python=${PYTHON:-python3}
prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
# The interpreter's own path, as setup.py passes it: another spelling of the
# same python would make CMake find Python anew and rebuild the extension.
python_exe=$("$python" -c "import sys; print(sys.executable)")

stage "build (library, tests)"
cmake -S . -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython_EXECUTABLE="$python_exe" \
  -DFUSEDMHA_BUILD_TESTS=ON \
  -DFUSEDMHA_BUILD_PYTHON=ON \
  -DFUSEDMHA_PYTHON_OUTPUT_DIR="$root/python/fusedmha"
cmake --build "$build" --parallel "${MAX_JOBS:-$(nproc)}"

stage "C++ tests (ctest)"
ctest --test-dir "$build" --output-on-failure

stage "Python tests (pytest)"
# A fresh compile cache: a cached graph of an older build could call an op
# with a schema that has since changed.
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest tests/python -q -rs -p no:cacheprovider "$@"
stage

# The same C++ under ASan + UBSan: ctest, pytest and a bounded fuzz run
# (skip with FUSEDMHA_SANITIZE_RUN=0).
if [ "${FUSEDMHA_SANITIZE_RUN:-1}" != 0 ]; then
  bash tests/sanitize.sh "$@"
fi
