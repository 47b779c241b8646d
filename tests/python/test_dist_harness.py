"""The rank harness itself (dist_harness.py): a rank that crashes fails the run at once with
its signal and Python stack; a hung one is killed at the deadline with its stacks shown, so a
CI log tells a crash, a hang and a slow machine apart."""
from __future__ import annotations

import time

import pytest

from dist_harness import run_ranks, slack


def crash_on_rank_1(rank, ws):
    import ctypes

    if rank == 1:
        ctypes.string_at(0)  # SIGSEGV in native code
    return rank


def hang_on_rank_1(rank, ws):
    if rank == 1:
        tide_test_hangs_here()
    return rank


def tide_test_hangs_here():
    time.sleep(3600)


def test_a_crashed_rank_fails_the_run_at_once_with_its_signal_and_stack():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(crash_on_rank_1, 2, backend=None, timeout=600)
    msg = str(failure.value)
    assert "rank 1 died without reporting: killed by SIGSEGV" in msg, msg
    assert "Segmentation fault" in msg and "crash_on_rank_1" in msg, msg
    # Not at the deadline (slack(600) s): within a few seconds of the crash.
    assert time.monotonic() - start < slack(20), msg


def test_a_hung_rank_is_killed_at_the_deadline_with_its_stacks():
    with pytest.raises(AssertionError) as failure:
        run_ranks(hang_on_rank_1, 2, backend=None, timeout=3)
    msg = str(failure.value)
    assert "ranks [1] did not finish within" in msg, msg
    assert "tide_test_hangs_here" in msg, msg  # its Python stack
