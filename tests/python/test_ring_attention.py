"""Context-parallel (ring) attention over 2 and 3 gloo processes on localhost: forward and
every gradient equal the single-process op on the whole sequence (ring_cases.py)."""

import pytest
import torch.distributed as dist

import ring_cases
from spawn_ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_matches_the_whole_sequence(world):
    run_ranks(ring_cases.all_cases, world)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_unshard(world):
    run_ranks(ring_cases.shard_and_unshard, world)


def test_bad_calls_get_clear_errors():
    run_ranks(ring_cases.errors, 2)
