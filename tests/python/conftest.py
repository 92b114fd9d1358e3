import os
import sys

import pytest
import torch

# Tests run against the package on sys.path: the installed one, or the
# in-place build of tests/run.sh (PYTHONPATH=python).
import fusedmha  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
