"""Fixtures every test file may use: the seed, the device a test runs on, random tensors on
it, and one intra-op thread for files of tiny cases."""

import pytest
import torch

# Tests run against the package on sys.path: the installed one, or the
# in-place build of tests/run.sh (PYTHONPATH=python). tests/python itself is
# on sys.path through pytest's `pythonpath` (pyproject.toml), for reference.py
# and the other helper modules.
import fusedmha  # noqa: F401
from devices import DEVICES


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=DEVICES)
def device(request):
    """The device a test runs on: "cpu", and "cuda" (skipped, with the reason, without a GPU)."""
    return request.param


@pytest.fixture
def rand(device):
    """rand(*shape, dtype=torch.float32): standard normal values on the test's device."""

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, device=device)

    return rand


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny cases: one intra-op thread is several times faster than two on a
    shared 2-core machine (test_mha_compile_export.test_threaded_parity takes every thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
