"""Misuse and failure of the tide backend: clear errors on every rank, timeouts instead of
hangs, and nothing left behind in /dev/shm or the fd table."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks, slack

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
        assert "bitwise" in errors["bitwise op"] and "f32" in errors["bitwise op"]
        assert "invalid root rank" in errors["bad root"] or "Invalid" in errors["bad root"]
        assert after == [2.0] * 5


def dead_peer_worker(rank, ws):
    t = torch.randn(1000)
    dist.all_reduce(t)  # everyone is alive here
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    msg = expect_error(lambda: dist.all_reduce(t))
    return msg, time.monotonic() - start


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.one_torch)])
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
        assert elapsed < PG_TIMEOUT_S + slack(2), f"rank {rank} took {elapsed:.1f} s"
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
    assert PG_TIMEOUT_S - 0.5 < elapsed < PG_TIMEOUT_S + slack(2), elapsed


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def tide_mappings():
    """Mappings of tide's shared segments (memfds: "/memfd:tide-host (deleted)")."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:tide-" in line)


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


# ---- torch's error types ---------------------------------------------------------------------

def error_types_worker(rank, ws):
    """A mismatch (RuntimeError, not DistBackendError), then a dead peer (DistBackendError,
    from Work.wait() and from a future alike)."""
    out = {}
    other = dist.new_group(backend="tide")  # a mismatch breaks its group, as in NCCL
    try:
        dist.all_reduce(torch.randn(10 + rank), group=other)
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = type(e).__name__
    t = torch.randn(100)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001
        out["dead peer"] = type(e).__name__
        out["dead peer msg"] = str(e)
        out["is DistBackendError"] = isinstance(e, dist.DistBackendError)
    try:
        work.get_future().wait()
    except Exception as e:  # noqa: BLE001
        out["future"] = type(e).__name__
    return out


def test_peer_failures_raise_dist_backend_error():
    res = run_ranks(error_types_worker, 2, pg_timeout_s=PG_TIMEOUT_S, expect_exit={1})
    out = res[0]
    assert out["mismatch"] == "RuntimeError", out
    assert out["is DistBackendError"] and out["dead peer"] == "DistBackendError", out
    assert "rank 1" in out["dead peer msg"], out
    assert out["future"] == "DistBackendError", out


def creation_timeout_worker(rank, ws):
    """Rank 1 never creates its group: rank 0's creation times out with DistBackendError."""
    from datetime import timedelta

    import tide

    store = dist.FileStore(os.environ["TIDE_TEST_STORE"], 2)
    if rank == 1:
        time.sleep(4)
        return None
    start = time.monotonic()
    try:
        tide._C.ProcessGroupTide(store, 0, 2, timedelta(seconds=2))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_group_creation_timeout_is_dist_backend_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDE_TEST_STORE", str(tmp_path / "store"))
    res = run_ranks(creation_timeout_worker, 2, backend=None)
    kind, msg, elapsed = res[0]
    assert kind == "DistBackendError", (kind, msg)
    assert "waiting for ranks [1] to join" in msg, msg
    assert 1.5 < elapsed < 2 + slack(2), elapsed


# ---- group creation under load (a zero store timeout once meant "forever") -------------------

def create_destroy_worker(rank, ws, store_dir, rounds):
    from datetime import timedelta

    import tide

    times = []
    for i in range(rounds):
        start = time.monotonic()
        store = dist.FileStore(os.path.join(store_dir, f"round{i}"), ws)
        pg = tide._C.ProcessGroupTide(store, rank, ws, timedelta(seconds=25))
        pg.barrier().wait()
        t = torch.full((1000,), float(rank))
        pg.allreduce([t]).wait()
        assert t[0].item() == ws * (ws - 1) / 2
        del pg
        times.append(time.monotonic() - start)
    return times


def busy_loop(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_group_creation_holds_under_oversubscription(tmp_path):
    """8 ranks create, use and destroy a group 3 times on 2 cores shared with 6 busy loops:
    every round completes (it hung before: a zero-timeout store probe waited forever), and
    nothing is left in /dev/shm."""
    import multiprocessing as mp

    before = tide_shm_entries()
    ctx = mp.get_context("spawn")
    busy = [ctx.Process(target=busy_loop, args=(120,), daemon=True) for _ in range(6)]
    for p in busy:
        p.start()
    try:
        res = run_ranks(create_destroy_worker, 8, str(tmp_path), 3, backend=None, timeout=150)
    finally:
        for p in busy:
            p.kill()
            p.join()
    for rank, times in enumerate(res):
        assert len(times) == 3 and max(times) < 25, f"rank {rank}: rounds took {times}"
    assert tide_shm_entries() == before


# ---- killed ranks at every moment of a group's life --------------------------------------------

def process_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between open and read
        return True


def kill_worker(rank, ws, moment, sig, store_dir):
    """The victim (last rank) is killed with `sig` at `moment`; survivors report what they saw
    and what they hold after destroying their group."""
    from datetime import timedelta

    import tide

    victim = ws - 1
    fds0, maps0 = fd_count(), tide_mappings()
    store = dist.FileStore(os.path.join(store_dir, "store"), ws)
    seen = None
    if moment == "start-up":
        # The victim publishes its part and waits for rank 0, which comes only once the
        # victim is dead: killed while it waits at start-up.
        if rank == victim:
            import threading

            store.set("victim", str(os.getpid()))
            threading.Timer(0.5, os.kill, (os.getpid(), sig)).start()
        elif rank == 0:
            pid = int(store.get("victim"))
            while not process_gone(pid):
                time.sleep(0.05)
        try:
            pg = tide._C.ProcessGroupTide(store, rank, ws, timedelta(seconds=PG_TIMEOUT_S * 3))
        except Exception as e:  # noqa: BLE001
            seen = type(e).__name__ + ": " + str(e)
            pg = None
    elif moment == "mid-collective":
        pg = tide._C.ProcessGroupTide(store, rank, ws, timedelta(seconds=PG_TIMEOUT_S * 3))
        t = torch.randn(1 << 20)
        pg.allreduce([t]).wait()
        if rank == victim:
            import threading

            threading.Timer(0.002, os.kill, (os.getpid(), sig)).start()
            while True:
                pg.allreduce([t]).wait()
        try:
            for _ in range(1000):
                pg.allreduce([t]).wait()
        except Exception as e:  # noqa: BLE001
            seen = type(e).__name__ + ": " + str(e)
    else:  # killed inside destroy_process_group
        dist.init_process_group("tide", store=store, rank=rank, world_size=ws,
                                timeout=timedelta(seconds=PG_TIMEOUT_S * 3))
        t = torch.randn(1 << 20)
        dist.all_reduce(t)
        if rank == victim:
            import threading

            threading.Timer(0.0005, os.kill, (os.getpid(), sig)).start()
        dist.destroy_process_group()
        if rank == victim:
            time.sleep(10)
        pg = None
    del pg
    import gc

    gc.collect()
    return seen, fds0, fd_count(), maps0, tide_mappings()


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.one_torch)])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("moment", ["start-up", "mid-collective", "destroy"])
def test_killed_rank_leaves_nothing_behind(moment, sig, ws, tmp_path):
    before = tide_shm_entries()
    res = run_ranks(kill_worker, ws, moment, sig, str(tmp_path), backend=None, expect_exit={ws - 1},
                    timeout=60)
    for rank in range(ws - 1):
        seen, fds0, fds1, maps0, maps1 = res[rank]
        if moment != "destroy":
            assert seen and seen.startswith("DistBackendError"), f"rank {rank}: {seen}"
            assert f"rank {ws - 1}" in seen, seen
        assert fds1 <= fds0, f"rank {rank}: {fds0} fds before, {fds1} after"
        assert maps1 == maps0, f"rank {rank}: {maps1 - maps0} tide mappings left"
    assert tide_shm_entries() == before


# ---- a quiet start ------------------------------------------------------------------------------

QUIET_START = r"""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import tide
rank, delay = int(sys.argv[1]), float(sys.argv[2])
# The store first (as torchrun's agent provides it), then the group: a late rank is late
# inside tide's rendezvous, not inside the store's.
store = dist.TCPStore("127.0.0.1", int(sys.argv[3]), 2, is_master=rank == 0, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
time.sleep(delay)
dist.init_process_group("tide", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == 2
dist.destroy_process_group()
"""


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_quiet_start(late_s):
    import subprocess
    import sys

    port = str(free_port())
    env = dict(os.environ, USE_LIBUV="0")
    env.pop("TIDE_DEBUG", None)
    procs = [subprocess.Popen([sys.executable, "-c", QUIET_START, str(r), str(late_s if r == 1 else 0), port],
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=slack(60))
        assert p.returncode == 0, err
        # torch's own import-time notices are not ours.
        errs.append([line for line in err.splitlines()
                     if "No CUDA runtime is found" not in line and line.strip()])
    return errs


def test_a_clean_start_prints_nothing_and_a_late_peer_one_line_at_most():
    for rank, lines in enumerate(run_quiet_start(0)):
        assert lines == [], f"rank {rank} printed on a clean start: {lines}"
    late = run_quiet_start(12)
    assert late[1] == [], late[1]
    assert len(late[0]) == 1, late[0]
    assert all("waits for ranks [1]" in line for line in late[0]), late[0]


# ---- what a finished collective held is released off the worker ------------------------------

def released_off_the_worker_worker(rank, ws):
    import gc
    import weakref

    t = torch.ones(1024)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    ref = weakref.ref(t)
    del work, t
    time.sleep(0.2)  # the worker is done with the work
    gc.collect()
    held_after_wait = ref() is not None
    dist.all_reduce(torch.ones(4))  # the next call releases it, on this thread
    gc.collect()
    return held_after_wait, ref() is not None


def test_a_finished_collective_is_released_by_the_caller_not_the_worker():
    """The worker never drops the last reference to a work's tensors: freeing a tensor's
    Python object takes the GIL, and a thread taking it while the interpreter finalizes is
    ended through a noexcept frame (std::terminate: the examples' test aborted so in 3 of 42
    runs on torch 2.11, after its last collective). The work's tensor outlives the caller's references until
    the caller's next collective releases it, on the caller's thread."""
    for rank, (after_wait, after_next) in enumerate(run_ranks(released_off_the_worker_worker, 2)):
        assert after_wait, f"rank {rank}: the worker released the work's tensor"
        assert not after_next, f"rank {rank}: the next collective did not release it"


# ---- the group's timeout changed after creation (dist.set_timeout) ----------------------------

def set_group_timeout(group, seconds):
    from datetime import timedelta

    if hasattr(dist, "set_timeout"):  # torch >= 2.15's public call
        dist.set_timeout(timedelta(seconds=seconds), group)
    else:  # what it calls: ProcessGroup.set_timeout forwards to every backend of the group
        group.set_timeout(timedelta(seconds=seconds))


LATE_S = 4  # a peer this late fails a group whose timeout is PG_TIMEOUT_S


def set_timeout_worker(rank, ws):
    """The default group was made with PG_TIMEOUT_S. A zero timeout is refused; lengthened,
    it lets a peer be LATE_S late in a standard collective and in FSDP2's first TIDE-AG (then
    a step's TIDE-AG and TIDE-RS); a second group made with a minute, shortened to PG_TIMEOUT_S, gives up on a
    silent peer after that, not after the minute."""
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    from tide.fsdp import _paths

    out = {"zero": expect_error(lambda: set_group_timeout(dist.group.WORLD, 0))}
    dist.all_reduce(torch.ones(4))  # the refusal left the group usable

    set_group_timeout(dist.group.WORLD, 60)
    if rank == 0:
        time.sleep(LATE_S)
    start = time.monotonic()
    t = torch.full((1000,), float(rank + 1))
    out["late all_reduce"] = expect_error(lambda: dist.all_reduce(t)), time.monotonic() - start
    out["sum"] = t[0].item()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)

    def step():
        if rank == 0:
            time.sleep(LATE_S)  # rank 1 waits in the first all-gather
        model(torch.randn(4, 64)).sum().backward()

    start = time.monotonic()
    out["late FSDP2 step"] = expect_error(step), time.monotonic() - start
    out["paths"] = dict(_paths.stats)

    other = dist.new_group(backend="tide", timeout=timedelta(seconds=60))
    set_group_timeout(other, PG_TIMEOUT_S)
    if rank == 0:
        time.sleep(PG_TIMEOUT_S + 1.5)  # never calls it
        return out
    start = time.monotonic()
    out["silent peer"] = expect_error(lambda: dist.all_reduce(t, group=other)), time.monotonic() - start
    return out


@pytest.mark.parametrize("nodes", [1, 2])
def test_set_timeout_reaches_every_communicator_of_the_group(monkeypatch, nodes):
    """dist.set_timeout on a tide group (torch 2.15's ProcessGroup.set_timeout forwards it to
    each backend; tide once ignored it): on one node the host communicator, across two
    pseudo-nodes the node communicators, TIDE-AG / TIDE-RS's gloo exchanges and the gloo
    delegate of the standard ops."""
    if nodes == 2:
        monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "1")
    results = run_ranks(set_timeout_worker, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=120)
    for rank, out in enumerate(results):
        assert "tide set_timeout" in out["zero"] and "must be positive" in out["zero"], out["zero"]
        assert f"rank {rank}" in out["zero"], out["zero"]
        msg, elapsed = out["late all_reduce"]
        assert msg is None, (rank, msg)
        assert out["sum"] == 3.0
        msg, elapsed = out["late FSDP2 step"]
        assert msg is None, (rank, msg)
        paths = out["paths"]  # TIDE's own collectives waited, not FSDP2's stock path
        assert paths["zero_copy_all_gather"] > 0 and paths["zero_copy_reduce_scatter"] > 0, (rank, paths)
        assert paths["stock_all_gather"] == 0 and paths["stock_reduce_scatter"] == 0, (rank, paths)
    for what in ("late all_reduce", "late FSDP2 step"):
        waited = results[1][what][1]
        assert waited > PG_TIMEOUT_S, f"{what}: rank 1 was not kept waiting past the creation timeout ({waited:.1f} s)"
    msg, elapsed = results[1]["silent peer"]
    # Across nodes the standard ops are the gloo delegate's: its error, as torch's DistBackendError.
    assert msg is not None and msg.startswith("DistBackendError: tide all"), msg
    assert ("rank 1 timed out" in msg and "rank 0" in msg) if nodes == 1 else "rank 1: across 2 nodes" in msg, msg
    assert PG_TIMEOUT_S - 0.5 < elapsed < PG_TIMEOUT_S + slack(3), f"gave up after {elapsed:.1f} s"


# ---- TORCH_DISTRIBUTED_DEBUG=DETAIL: torch's wrapper checks each collective across ranks -------

def debug_detail(rank):
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # the fork server imported torch before the test


def debug_detail_worker(rank, ws):
    """Through the wrapper that DETAIL puts around every backend: an FSDP2 step on TIDE's
    path and a standard op (the wrapper compares each collective's sequence number and
    arguments across ranks first: the backend's sequence numbers must agree), then a shape
    mismatch, which the wrapper reports before the collective runs."""
    from torch.distributed.fsdp import fully_shard

    from tide.fsdp import _paths

    out = {"backend": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
    out["paths"] = dict(_paths.stats)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    out["mismatch"] = expect_error(lambda: dist.all_reduce(torch.ones(10 + rank)))
    return out


def test_torch_distributed_debug_detail_wraps_a_tide_group():
    """tide once failed the first collective under DETAIL ("Backend tide does not yet support
    sequence numbers"), and its FSDP2 path did not see the tide group under the wrapper."""
    for rank, out in enumerate(run_ranks(debug_detail_worker, 2, before_init=debug_detail, pg_timeout_s=30)):
        assert out["backend"] == "_ProcessGroupWrapper", out["backend"]
        paths = out["paths"]
        assert paths["zero_copy_all_gather"] > 0 and paths["zero_copy_reduce_scatter"] > 0, (rank, paths)
        assert paths["stock_all_gather"] == 0 and paths["stock_reduce_scatter"] == 0, (rank, paths)
        assert out["sum"] == [3.0] * 4
        assert out["mismatch"] and "Detected mismatch between collectives" in out["mismatch"], out["mismatch"]


# ---- abort: torch's _abort_process_group (fault-tolerant training's way out of a hang) --------

def abort_worker(rank, ws):
    """Rank 0's all_reduce waits on rank 1, which is late; rank 0 aborts the job's groups.
    The abort returns at once, the waiting collective fails, and rank 1's all_reduce, when
    it comes, fails fast naming rank 0's abort (the group's timeout is a minute)."""
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(1.5)
        start = time.monotonic()
        return expect_error(lambda: dist.all_reduce(torch.ones(4))), time.monotonic() - start
    work = dist.all_reduce(torch.ones(4), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    dist.distributed_c10d._abort_process_group()
    aborted_after = time.monotonic() - start
    return aborted_after, expect_error(work.wait), time.monotonic() - start


def test_abort_ends_a_hung_collective_at_once():
    """ProcessGroupTide::abort (tide once ignored it: the abort waited for the hung
    collective's timeout, as did the group's destruction)."""
    (aborted_after, msg0, waited0), (msg1, waited1) = run_ranks(abort_worker, 2, pg_timeout_s=60, timeout=60)
    assert aborted_after < slack(1), aborted_after
    assert msg0 and msg0.startswith("DistBackendError") and "aborted group" in msg0, msg0
    assert waited0 < slack(1), waited0
    assert msg1 and msg1.startswith("DistBackendError") and "because rank 0 aborted" in msg1, msg1
    assert waited1 < slack(2), waited1
