"""The devices the tests run on: the CPU, and CUDA where a GPU is visible and fusedmha was
built with CUDA kernels. Elsewhere the CUDA cases are collected and skipped with the reason
(`pytest -rs` prints it); `pytest -m cuda` selects every CUDA case."""

import pytest
import torch

import fusedmha


def _cuda_missing():
    """Why the CUDA cases cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (torch.cuda.is_available() is False)"
    if not fusedmha.build_info()["cuda"]:
        return "fusedmha was built without CUDA kernels"
    return None


CUDA_MISSING = _cuda_missing()

# The marks of every CUDA case (a test module of CUDA-only tests uses them as pytestmark).
CUDA = [pytest.mark.cuda, pytest.mark.skipif(CUDA_MISSING is not None, reason=str(CUDA_MISSING))]

# The `device` fixture's parameters (conftest.py).
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]


def on_devices(cases, cuda_only=()):
    """Parameters (device, *case) for @pytest.mark.parametrize("device,..."): every case on
    both devices, and the cases of `cuda_only` (sizes too large for the CPU suite) on CUDA."""
    params = [pytest.param("cpu", *case) for case in cases]
    params += [pytest.param("cuda", *case, marks=CUDA) for case in list(cases) + list(cuda_only)]
    return params
