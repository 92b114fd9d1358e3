#!/usr/bin/env bash
# The one prepared run on a GPU machine (the device tool's lent GPU): builds
# the package with CUDA kernels into a scratch target against the torch
# installed there, runs the CUDA tests (every pytest case marked cuda), then the
# GPU benchmark, within a time budget. Writes log.txt, pytest.xml and
# bench.md (row by row, so a run cut short keeps what it measured) to $OUT.
#
#   OUT=/tmp/gpu bash tests/gpu_check.sh [--full]
#
# Quick by default (tests without the 8192² cases, benchmark at L=1024 and
# 4096); --full runs everything. BUDGET (seconds, default 540) bounds the
# whole run. TORCH_CUDA_ARCH_LIST defaults to the GPU's own architecture,
# to keep the build short. Needs cmake, pytest, Python headers and a CUDA
# toolkit whose major version matches torch's; wheels in $WHEELS (if set)
# are installed first, for machines without network access.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedmha_gpu_check}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
python=${PYTHON:-python3}
full=$([ "${1:-}" = "--full" ] && echo 1 || echo "")

left() { echo $(( BUDGET - SECONDS )); }

main() {
  echo "== machine"
  date
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$python" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  if [ -n "${WHEELS:-}" ]; then "$python" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || true; fi
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  local missing=""
  command -v nvcc >/dev/null || missing+=" nvcc"
  command -v cmake >/dev/null || "$python" -c "import cmake" 2>/dev/null || missing+=" cmake"
  "$python" -c "import pytest" 2>/dev/null || missing+=" pytest"
  "$python" -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
    2>/dev/null || missing+=" Python.h"
  if [ -n "$missing" ]; then echo "MISSING:$missing"; return 2; fi
  nvcc --version | tail -1

  echo "== build (pip install --no-build-isolation --target)"
  local scratch arch start
  scratch=$(mktemp -d)
  arch=$("$python" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')")
  start=$SECONDS
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} FUSEDMHA_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$python" -m pip install --no-build-isolation --no-deps --target "$scratch" . > "$OUT/build.txt" 2>&1 \
    || { tail -40 "$OUT/build.txt"; echo "BUILD FAILED"; return 1; }
  echo "build took $(( SECONDS - start )) s"
  export PYTHONPATH="$scratch"

  echo "== CUDA tests ($(left) s left)"
  local select=()
  [ -z "$full" ] && select=(-k "not 8192")
  # Launch errors surface at the kernel that caused them; 150 s stay for the benchmark.
  (cd tests/python && CUDA_LAUNCH_BLOCKING=1 timeout $(( $(left) - 150 )) "$python" -m pytest -q -rs \
    -p no:cacheprovider --junitxml="$OUT/pytest.xml" -m cuda . ${select[@]+"${select[@]}"})
  local tests_rc=$?

  echo "== benchmark ($(left) s left)"
  if [ "$(left)" -gt 30 ]; then
    timeout $(( $(left) - 10 )) "$python" benchmarks/bench_sdpa_cuda.py $([ -z "$full" ] && echo --quick) \
      --markdown "$OUT/bench.md"
  fi
  echo "tests exit code: $tests_rc"
  return $tests_rc
}

main 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
