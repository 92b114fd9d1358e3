#!/usr/bin/env bash
# Runs every test of fusedmha: builds the library, the Python extension (in
# place, into python/fusedmha/) and the GoogleTest suite with CMake, then runs
# ctest and pytest against that build.
#
#   bash tests/run.sh [pytest args]
#
# Then the same again under ASan + UBSan (tests/sanitize.sh; skipped with
# FUSEDMHA_SANITIZE_RUN=0). Installs what is missing first (tests/install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bash tests/install_deps.sh
build="${FUSEDMHA_TEST_BUILD_DIR:-$root/build/tests}"
python=${PYTHON:-python3}
prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")

cmake -S . -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  -DFUSEDMHA_BUILD_TESTS=ON \
  -DFUSEDMHA_BUILD_PYTHON=ON \
  -DFUSEDMHA_PYTHON_OUTPUT_DIR="$root/python/fusedmha"
cmake --build "$build" --parallel "${MAX_JOBS:-$(nproc)}"

echo "== C++ tests (ctest) =="
ctest --test-dir "$build" --output-on-failure

echo "== Python tests (pytest) =="
# A fresh compile cache: a cached graph of an older build could call an op
# with a schema that has since changed.
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest tests/python -q -rs -p no:cacheprovider "$@"

# The same C++ under ASan + UBSan: ctest, pytest and a bounded fuzz run
# (skip with FUSEDMHA_SANITIZE_RUN=0).
if [ "${FUSEDMHA_SANITIZE_RUN:-1}" != 0 ]; then
  bash tests/sanitize.sh "$@"
fi
