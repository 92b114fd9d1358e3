#!/usr/bin/env bash
# The one prepared run on a GPU machine (the device tool's H200): builds the
# package with CUDA kernels into a scratch target against the torch installed
# there, runs the CUDA tests (tests/python/test_cuda.py and the GoogleTest
# case when gtest is there), then the GPU benchmark. Writes log.txt,
# pytest.xml and bench.md to $OUT.
#
#   OUT=/tmp/gpu bash tests/gpu_check.sh [--quick]
#
# TORCH_CUDA_ARCH_LIST defaults to the GPU's own architecture here, to keep
# the build short. Needs cmake, pytest and a CUDA toolkit whose major
# version matches torch's; wheels in $WHEELS (if set) are installed first,
# for machines without network access.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedmha_gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
quick=${1:-}
python=${PYTHON:-python3}

echo "== machine"
date
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$python" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
command -v nvcc && nvcc --version | tail -1
if [ -n "${WHEELS:-}" ]; then "$python" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || true; fi

echo "== build (pip install --no-build-isolation --target)"
scratch=$(mktemp -d)
arch=$("$python" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')")
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} FUSEDMHA_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$python" -m pip install -q --no-build-isolation --no-deps --target "$scratch" . || { echo "BUILD FAILED"; exit 1; }
echo "build took $(( $(date +%s) - start )) s"
export PYTHONPATH="$scratch:$PWD/tests/python"

echo "== CUDA tests"
(cd tests/python && "$python" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" test_cuda.py \
  ${quick:+-k "not 8192"})
tests_rc=$?

echo "== benchmark"
timeout 420 "$python" benchmarks/bench_sdpa_cuda.py ${quick} --markdown "$OUT/bench.md"
echo "tests exit code: $tests_rc"
exit $tests_rc
