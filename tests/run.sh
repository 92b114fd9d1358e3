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

sanitize=${FUSEDMHA_SANITIZE_RUN:-1}
if [ "$sanitize" != 0 ]; then
  # The sanitizer build (tests/sanitize.sh: instrumented, CPU only) in the
  # background at the lowest priority while the tests below run: it takes
  # the cores they leave idle (most of pytest runs on one), and ends with the
  # script if a test fails.
  sanitize_log="$build/sanitize_build.log"
  nice -n 19 setsid bash tests/sanitize.sh --build-only > "$sanitize_log" 2>&1 &
  sanitize_build=$!
  trap 'kill -- -"$sanitize_build" 2>/dev/null || true' EXIT
fi

stage "C++ tests (ctest)"
ctest --test-dir "$build" --output-on-failure

stage "Python tests (pytest)"
# A fresh compile cache: a cached graph of an older build could call an op
# with a schema that has since changed.
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"; [ -z "${sanitize_build:-}" ] || kill -- -"$sanitize_build" 2>/dev/null || true' EXIT
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest tests/python -q -rs -p no:cacheprovider "$@"
stage

# The same C++ under ASan + UBSan: ctest and a bounded fuzz run (skip with
# FUSEDMHA_SANITIZE_RUN=0).
if [ "$sanitize" != 0 ]; then
  stage "sanitizer build (what is left)"
  if ! wait "$sanitize_build"; then
    cat "$sanitize_log"
    echo "tests/run.sh: the sanitizer build failed (log above: $sanitize_log)" >&2
    exit 1
  fi
  sanitize_build=""
  tail -n 2 "$sanitize_log"
  stage
  bash tests/sanitize.sh --tests-only "$@"
fi
