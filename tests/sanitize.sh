#!/usr/bin/env bash
# The C++ code under AddressSanitizer + UndefinedBehaviorSanitizer: builds the
# library, its Python extension and the GoogleTest suite with
# FUSEDMHA_SANITIZE=address,undefined (CPU kernels) into build/sanitize, then
#  1. the C++ tests, with LeakSanitizer;
#  2. a bounded fuzz run (tests/python/fuzz), and
#  3. with FUSEDMHA_SANITIZE_PYTEST=1, the whole Python test suite (about
#     three times its normal time: left out of CI, which must stay under 40
#     minutes on 2 cores),
# the last two in a python that has the sanitizer runtimes preloaded and
# imports fusedmha from that build. Any finding aborts the run (the build
# stops at the first UBSan report; ASan stops at its first).
#
# What is covered: the CPU kernels at the ISA levels this machine runs (the
# baseline up to the widest that torch.backends.cpu.get_cpu_capability()
# reports), every host path, the ops, the modules and the C++ API. Not
# covered: wider levels than the machine runs (they cannot execute here, and
# compiling them instrumented costs most of the build: set
# FUSEDMHA_SANITIZE_ALL_ISAS=1 to compile them anyway), and the CUDA code
# (host wrappers and kernels), which needs a GPU to run.
#
#   bash tests/sanitize.sh
#   FUSEDMHA_SANITIZE_PYTEST=1 bash tests/sanitize.sh [pytest args]   # + pytest
#   FUSEDMHA_FUZZ_CALLS=20000 FUSEDMHA_FUZZ_SEED=1 bash tests/sanitize.sh   # a longer fuzz run
#   bash tests/sanitize.sh --build-only | --tests-only [pytest args]  # one half
#
# Called by tests/run.sh (the build in the background while the ordinary
# tests run, then the tests). Needs gcc's libasan/libubsan
# (tests/install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
step=all
case "${1:-}" in
  --build-only) step=build; shift ;;
  --tests-only) step=tests; shift ;;
esac
root=$(pwd)
build="${FUSEDMHA_SANITIZE_BUILD_DIR:-$root/build/sanitize}"
python=${PYTHON:-python3}
prefix=$("$python" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
package="$build/package"
source tests/stages.sh
# The widest ISA level to compile: the one this machine runs at.
isa_max=AVX512
if [ "${FUSEDMHA_SANITIZE_ALL_ISAS:-0}" != 1 ]; then
  isa_max=$("$python" -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
print('AVX512' if 'AVX512' in c else 'AVX2' if 'AVX2' in c else 'DEFAULT')")
fi

if [ "$step" != tests ]; then
stage "sanitizer build (CPU ISAs up to $isa_max)"
cmake -S . -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  -DFUSEDMHA_SANITIZE=address,undefined \
  -DFUSEDMHA_CUDA=0 \
  -DFUSEDMHA_CPU_ISA_MAX="$isa_max" \
  -DFUSEDMHA_BUILD_TESTS=ON \
  -DFUSEDMHA_BUILD_PYTHON=ON \
  -DFUSEDMHA_PYTHON_OUTPUT_DIR="$package/fusedmha"
cmake --build "$build" --parallel "${MAX_JOBS:-$(nproc)}"
# The package: python/fusedmha's sources next to the sanitized libraries (and
# the build's own _build_config.py).
find python/fusedmha -name '*.py' ! -name _build_config.py | while read -r f; do
  mkdir -p "$package/$(dirname "${f#python/}")"
  cp "$f" "$package/${f#python/}"
done
fi
if [ "$step" = build ]; then
  stage
  exit 0
fi

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
stage "sanitized C++ tests (ctest)"
# (installed_package builds an example against an installed copy: a packaging
# test, run by tests/run.sh)
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 \
  ctest --test-dir "$build" --output-on-failure -E installed_package

runtimes="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)"
for lib in $runtimes; do
  [ -f "$lib" ] || { echo "sanitize.sh: $lib not found (install gcc's sanitizer runtimes)"; exit 1; }
done
# CPython and torch keep allocations until exit by design: no leak check here
# (the C++ tests above have it). Resident-memory figures mean nothing under
# ASan's quarantine, so test_leaks.py runs only in tests/run.sh.
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
sanitized() {
  (cd "$build" && LD_PRELOAD="$runtimes" PYTHONPATH="$package:$root/tests/python" "$python" "$@")
}
sanitized -c "import fusedmha, os; assert fusedmha.__file__.startswith('$package'), fusedmha.__file__"

stage "sanitized fuzz run"
# Seed 1: test_fuzz.py runs seed 0 in the ordinary build.
sanitized "$root/tests/python/fuzz" --quiet --strict \
  --calls "${FUSEDMHA_FUZZ_CALLS:-1500}" --seed "${FUSEDMHA_FUZZ_SEED:-1}"

if [ "${FUSEDMHA_SANITIZE_PYTEST:-0}" = 1 ]; then
  stage "sanitized Python tests (pytest)"
  sanitized -m pytest "$root/tests/python" -q -p no:cacheprovider \
    --ignore="$root/tests/python/test_leaks.py" --ignore="$root/tests/python/test_fuzz.py" "$@"
fi
stage
