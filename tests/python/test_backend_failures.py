"""Misuse and failure of the tide backend: clear errors on every rank, timeouts instead of
hangs, and nothing left behind in /dev/shm or the fd table."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks

PG_TIMEOUT_S = 3


def tide_shm_entries():
    return sorted(e for e in os.listdir("/dev/shm") if "tide" in e)


def expect_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def mismatched_sizes_worker(rank, ws):
    inp = torch.randn(10 + rank)  # rank r contributes 10 + r elements
    out = torch.empty((10 + rank) * ws)
    return expect_error(lambda: dist.all_gather_into_tensor(out, inp))


def mismatched_dtypes_worker(rank, ws):
    t = torch.randn(16, dtype=torch.float32 if rank == 0 else torch.float64)
    return expect_error(lambda: dist.all_reduce(t))


def local_misuse_worker(rank, ws):
    errors = {
        "bad output size": expect_error(
            lambda: dist.all_gather_into_tensor(torch.empty(3), torch.empty(2))),
        "bitwise op": expect_error(lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)),
        "bad root": expect_error(lambda: dist.broadcast(torch.empty(4), src=ws + 3)),
        "mixed dtypes": expect_error(lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.float64), torch.empty(2 * ws, dtype=torch.bfloat16))),
    }
    # The group still works after local errors (they never reach the peers).
    t = torch.ones(5)
    dist.all_reduce(t)
    return errors, t.tolist()


def test_mismatched_sizes_raise_on_every_rank():
    msgs = run_ranks(mismatched_sizes_worker, 2, pg_timeout_s=PG_TIMEOUT_S)
    for rank, msg in enumerate(msgs):
        assert msg is not None, f"rank {rank} did not raise"
        assert "RuntimeError" in msg and "all_gather" in msg, msg
        assert "10" in msg and "11" in msg, f"sizes missing from: {msg}"
        assert "timed out" not in msg, f"a mismatch must be reported, not time out: {msg}"


def test_mismatched_dtypes_raise_on_every_rank():
    msgs = run_ranks(mismatched_dtypes_worker, 3, pg_timeout_s=PG_TIMEOUT_S)
    for rank, msg in enumerate(msgs):
        assert msg is not None and "all_reduce" in msg, f"rank {rank}: {msg}"
        assert "f32" in msg and "f64" in msg, msg


def test_local_misuse_is_rejected_with_context():
    results = run_ranks(local_misuse_worker, 2, pg_timeout_s=PG_TIMEOUT_S)
    for rank, (errors, after) in enumerate(results):
        for what, msg in errors.items():
            assert msg is not None, f"rank {rank}: {what} was accepted"
            assert f"rank {rank}" in msg, f"{what}: no rank in {msg}"
        assert "elements" in errors["bad output size"]
        assert "BAND" in errors["bitwise op"] or "not supported" in errors["bitwise op"]
        assert after == [2.0] * 5


def dead_peer_worker(rank, ws):
    t = torch.randn(1000)
    dist.all_reduce(t)  # everyone is alive here
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    msg = expect_error(lambda: dist.all_reduce(t))
    return msg, time.monotonic() - start


@pytest.mark.parametrize("ws", [2, 3])
def test_dead_peer_raises_on_every_survivor(ws):
    before = tide_shm_entries()
    results = run_ranks(dead_peer_worker, ws, pg_timeout_s=PG_TIMEOUT_S, expect_exit={1},
                        timeout=60)
    for rank, res in enumerate(results):
        if rank == 1:
            continue
        msg, elapsed = res
        assert msg is not None, f"rank {rank} did not notice the dead peer"
        assert "rank 1" in msg, msg
        assert elapsed < PG_TIMEOUT_S + 5, f"rank {rank} took {elapsed:.1f} s"
    assert tide_shm_entries() == before


def silent_peer_worker(rank, ws):
    t = torch.randn(100)
    if rank == 0:
        time.sleep(PG_TIMEOUT_S + 2)  # never calls the collective
        return None
    start = time.monotonic()
    msg = expect_error(lambda: dist.all_reduce(t))
    return msg, time.monotonic() - start


def test_silent_peer_times_out():
    results = run_ranks(silent_peer_worker, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=60)
    msg, elapsed = results[1]
    assert msg is not None and "rank 0" in msg, msg
    assert PG_TIMEOUT_S - 0.5 < elapsed < PG_TIMEOUT_S + 5, elapsed


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def tide_mappings():
    """Shared-memory mappings of tide segments (unlinked names stay listed as deleted)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/tide" in line)


def lifecycle_worker(rank, ws, mode):
    fds_before, maps_before = fd_count(), tide_mappings()
    group = dist.new_group(backend="tide")
    t = torch.randn(1 << 20)
    dist.all_reduce(t, group=group)
    maps_during = tide_mappings()
    if mode == "exception":
        assert expect_error(lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND, group=group))
    dist.destroy_process_group(group)
    del group
    import gc

    gc.collect()
    return fds_before, fd_count(), maps_before, tide_mappings(), maps_during


@pytest.mark.parametrize("mode", ["clean", "exception"])
def test_no_leaks_after_group_destruction(mode):
    before = tide_shm_entries()
    results = run_ranks(lifecycle_worker, 2, mode, pg_timeout_s=PG_TIMEOUT_S)
    for rank, (fds_before, fds_after, maps_before, maps_after, maps_during) in enumerate(results):
        assert fds_after <= fds_before, f"rank {rank}: {fds_before} fds before, {fds_after} after"
        assert maps_during > maps_before, "the check must see the group's own mappings"
        assert maps_after == maps_before, f"rank {rank}: {maps_after - maps_before} mappings left"
    assert tide_shm_entries() == before


def cuda_memory_without_device_worker(rank, ws):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return expect_error(lambda: backend.allocate_symmetric(1024, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_symmetric_memory_without_a_device_is_a_clear_error():
    import tide

    err = run_ranks(cuda_memory_without_device_worker, 2)
    for r, e in enumerate(err):
        assert e is not None, f"rank {r}: no error"
        if tide._C.has_cuda:
            assert "no CUDA device" in e and f"rank {r}" in e, e
        else:
            assert "built without CUDA" in e, e
