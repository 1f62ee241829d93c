"""The fused step's thread team (team.h): its barriers hold every thread until all arrive, and a
thread that fails stops the others at their next barrier instead of leaving them waiting: the
error reaches the caller and the pool serves the next step."""

from __future__ import annotations

import pytest
import torch

from backfill import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")


@pytest.fixture
def ext():
    threads = torch.get_num_threads()
    yield kernels.extension()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_barriers_hold_every_thread(ext, num_threads: int) -> None:
    """3 threads: more than a 2-core machine has cores, so waiting threads must yield theirs."""
    torch.set_num_threads(num_threads)
    assert ext.team_selftest(300) == num_threads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("fail_round", [0, 7])
def test_a_failing_thread_raises_and_the_next_team_runs(ext, num_threads: int, fail_round: int) -> None:
    torch.set_num_threads(num_threads)
    for fail_thread in (0, num_threads - 1):
        with pytest.raises(RuntimeError, match=f"team thread {fail_thread} failed in round {fail_round}"):
            ext.team_selftest(20, fail_thread, fail_round)
        assert ext.team_selftest(20) == num_threads
