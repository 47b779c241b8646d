"""FSDP2 on CUDA tensors of a tide group: TIDE-AG and TIDE-RS on the GPUs (src/torch/cuda).

Needs a GPU and a tide built with CUDA; skips otherwise. Several ranks share one GPU as
processes (CUDA IPC works between processes on one device; NCCL would refuse), so nothing
here may touch the NCCL delegate: results travel back as CPU tensors, never through a CUDA
collective. The references are independent: stock FSDP2 over gloo on CPU, a single-process
model, and float64 / rank-order fp32 sums computed on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

try:
    import tide._C as _tide_C

    _HAS_TIDE_CUDA = bool(_tide_C.has_cuda)
except ImportError:  # pragma: no cover  tide._C not built
    _HAS_TIDE_CUDA = False

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _HAS_TIDE_CUDA, reason="tide built without CUDA"),
]

# Uneven shapes (empty shards, padding) sharded on dim 0.
SHAPES = [(37, 5), (8,), (3, 11, 4), (1, 7), (130, 33)]


def _set_device(rank):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _fsdp_shard(full, rank, ws, padded_numel):
    """FSDP2's dim-0 shard of `full` for `rank`, flattened and zero-padded."""
    chunks = torch.chunk(full, ws, dim=0)
    flat = chunks[rank].reshape(-1) if rank < len(chunks) else full.new_zeros(0)
    out = full.new_zeros(padded_numel)
    out[: flat.numel()] = flat
    return out


def _all_gather_setup(rank, ws, backend, dev, shapes, seed, storage_dtype=torch.float32):
    """A planner layout for `shapes`, this rank's fp32 FSDP2 shards in CUDA symmetric memory,
    the full tensors (the same on every rank) and NaN-poisoned unsharded storages."""
    import tide

    plan = tide._C.plan
    layout = plan.plan_group([plan.Param(list(s), 4, 0) for s in shapes], ws)
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    offsets, total = [], 0
    for lp in layout.params:
        offsets.append(total)
        total += (lp.padded_shard_numel * 4 + 255) // 256 * 256
    shards = backend.allocate_symmetric(total, dev.index)
    assert shards.device == str(dev), shards.device
    for full, lp, off in zip(fulls, layout.params, offsets):
        shards.tensor(rank, off, lp.padded_shard_numel, torch.float32).copy_(
            _fsdp_shard(full, rank, ws, lp.padded_shard_numel).to(dev))
    storages = [torch.full((lp.storage_numel,), float("nan"), dtype=storage_dtype, device=dev)
                for lp in layout.params]
    return layout, shards, offsets, fulls, storages


def direct_worker(rank, ws, seed, grad_dtype, mismatch=False, die=False, side_stream=False):
    """param_all_gather and param_reduce_scatter called on the backend directly. The
    storages take the gradient dtype (bf16: the cast kernel runs first). side_stream: both
    are issued on a side stream and consumed, after Work.wait(), on the default stream."""
    import contextlib
    import os
    import time

    import torch.distributed as dist

    dev = _set_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    shapes = list(SHAPES)
    if mismatch and rank == 1:
        shapes[0] = (36, 5)
    layout, shards, offsets, fulls, storages = _all_gather_setup(rank, ws, backend, dev, shapes,
                                                                 seed, storage_dtype=grad_dtype)
    if die and rank == 1:
        os._exit(0)  # a peer that never arrives: the others must time out, not hang
    issue = contextlib.nullcontext()
    if side_stream:  # after the default stream's setup, as any user of a side stream must
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        issue = torch.cuda.stream(side)
    start = time.monotonic()
    try:
        with issue:
            work = backend.param_all_gather(layout, shards, offsets, torch.float32, storages)
    except RuntimeError as e:
        return dict(error=str(e), backend_error=isinstance(e, dist.DistBackendError),
                    elapsed=time.monotonic() - start)
    work.wait()  # the default stream waits for the side stream's collective
    gathered_ok = [torch.equal(st[: f.numel()].cpu(), f.reshape(-1).to(grad_dtype))
                   for st, f in zip(storages, fulls)]

    # TIDE-RS: every rank's gradients are known to all (seeded by rank): rank-order fp32
    # sums (bitwise) and float64 sums (tolerance) as references.
    def grads_of(r):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        return [torch.randn(s, generator=g).to(grad_dtype) for s in shapes]

    mine = [g.to(dev) for g in grads_of(rank)]
    padded = [lp.padded_shard_numel for lp in layout.params]
    out_offsets = [sum(padded[:i]) for i in range(len(padded))]
    out = torch.full((sum(padded),), float("nan"), device=dev)
    if side_stream:
        side.wait_stream(torch.cuda.current_stream())
    with issue:
        work = backend.param_reduce_scatter(layout, mine, out, out_offsets, dist.ReduceOp.SUM)
    work.wait()
    got = out.cpu()
    want32 = torch.zeros_like(got)
    want64 = torch.zeros(got.numel(), dtype=torch.float64)
    for r in range(ws):
        flat = torch.cat([_fsdp_shard(g, rank, ws, n) for g, n in zip(grads_of(r), padded)])
        want32 += flat.float()
        want64 += flat.double()
    torch.cuda.synchronize()
    return dict(gathered_ok=gathered_ok, rs_bitwise=torch.equal(got, want32),
                rs_err=(got.double() - want64).abs().max().item(),
                report=(backend.last_staging_report().num_slots,
                        backend.last_staging_report().slot_bytes))


@pytest.mark.parametrize("ws, grad_dtype, side_stream", [
    (1, torch.float32, False), (2, torch.float32, True), (2, torch.bfloat16, False),
    (4, torch.bfloat16, True), (8, torch.float32, False)])
def test_param_collectives_match_references(ws, grad_dtype, side_stream):
    for res in run_ranks(direct_worker, ws, 7, grad_dtype, kwargs=dict(side_stream=side_stream),
                         timeout=180):
        assert all(res["gathered_ok"]), res["gathered_ok"]
        assert res["rs_bitwise"], f"not the rank-order fp32 sum (max error {res['rs_err']})"
        assert res["rs_err"] < 1e-4


def no_kernel_worker(rank, ws):
    """The CUDA kernels the profiler (CUPTI) sees while TIDE-AG runs, equal dtypes."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dev = _set_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    layout, shards, offsets, fulls, storages = _all_gather_setup(rank, ws, backend, dev, SHAPES, 11)
    backend.param_all_gather(layout, shards, offsets, torch.float32, storages).wait()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend.param_all_gather(layout, shards, offsets, torch.float32, storages).wait()
        torch.cuda.synchronize()
    gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in gpu if "memcpy" not in n.lower() and "memset" not in n.lower()]
    copies = [n for n in gpu if "memcpy" in n.lower()]
    ok = [torch.equal(st[: f.numel()].cpu(), f.reshape(-1)) for st, f in zip(storages, fulls)]
    return dict(kernels=kernels, copies=len(copies), ok=all(ok))


def test_all_gather_launches_no_kernel():
    """Copy engines only: the profiler sees copies and not a single kernel."""
    for res in run_ranks(no_kernel_worker, 2):
        assert res["ok"]
        assert res["copies"] > 0, "the profiler saw no copies: it did not record the device"
        assert not res["kernels"], f"kernels on the all-gather path: {res['kernels']}"


def test_mismatched_calls_raise_on_every_rank():
    res = run_ranks(direct_worker, 2, 3, torch.float32, kwargs=dict(mismatch=True))
    for r in res:
        assert "do not match" in r["error"] and "param_all_gather" in r["error"], r


def test_dead_peer_is_a_backend_error_naming_it():
    """docs/status.md's contract for a peer that dies after joining: the survivor's collective
    raises DistBackendError naming the dead rank, within the group's timeout (5 s here)."""
    res = run_ranks(direct_worker, 2, 3, torch.float32, kwargs=dict(die=True),
                    pg_timeout_s=5, expect_exit={1}, timeout=120)
    assert res[0]["backend_error"], res[0]
    assert "rank 1" in res[0]["error"] and "param_all_gather" in res[0]["error"], res[0]
    assert res[0]["elapsed"] < 5 + 10, res[0]


def hung_peer_worker(rank, ws):
    """Rank 1's stream is busy for 10 s before its all-gather can start: it passes the host
    check but posts nothing for longer than the 3 s timeout. Rank 0's watchdog must abort,
    rank 1 must learn of it, and both must raise instead of returning data."""
    import time

    import torch.distributed as dist

    dev = _set_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    layout, shards, offsets, fulls, storages = _all_gather_setup(rank, ws, backend, dev, SHAPES, 5)
    torch.cuda.synchronize()
    if rank == 1:
        torch.cuda._sleep(int(10 * 2.0e9))  # about 10 s of GPU clock cycles
    start = time.monotonic()
    work = backend.param_all_gather(layout, shards, offsets, torch.float32, storages)
    while time.monotonic() - start < 60:
        try:
            work.wait()
            torch.cuda.synchronize()  # returns once the abort released this rank's streams
            backend.param_all_gather(layout, shards, offsets, torch.float32, storages).wait()
        except RuntimeError as e:
            return dict(error=str(e), elapsed=time.monotonic() - start)
        time.sleep(0.2)
    return dict(error=None, elapsed=time.monotonic() - start)


def test_hung_peer_aborts_the_group_on_every_rank():
    res = run_ranks(hung_peer_worker, 2, pg_timeout_s=3, timeout=120)
    for r, out in enumerate(res):
        assert out["error"], f"rank {r} returned data after a peer hung: {out}"
        assert "abort" in out["error"] or "did not complete" in out["error"], out
        assert out["elapsed"] < 40, out


# ---- FSDP2 end to end ------------------------------------------------------------------------
STEPS = 3


def fsdp_worker(rank, ws, device_type, zero_copy=True, bf16=False, shard1=False,
                profile=False, slot_reuse=False):
    """AwkwardModel (tests/python/test_fsdp_zero_copy.py) under FSDP2; returns the losses
    and this rank's local shards on the CPU (no CUDA collective: NCCL is not usable with
    several ranks on one GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    import tide.fsdp
    from test_fsdp_zero_copy import AwkwardModel, batch, loss_of

    import os

    os.environ["TIDE_SLOT_REUSE"] = "1" if slot_reuse else "0"
    if not zero_copy:
        tide.fsdp.uninstall()
    dev = _set_device(rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = AwkwardModel().to(dev)
    mesh = init_device_mesh(device_type, (ws,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())

    def placement(p):
        return Shard(1) if shard1 and p.ndim == 2 and p.shape[1] % ws == 0 else None

    for layer in model.llama.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, names = [], set()
    for step in range(STEPS):
        prof = torch.profiler.profile() if profile and step == STEPS - 1 else None
        if prof:
            prof.__enter__()
        loss = loss_of(model, batch(step, rank).to(dev))
        loss.backward()
        if prof:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            names |= {e.name for e in prof.events()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    shards = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    reused = None
    if zero_copy and device_type == "cuda":
        import torch.distributed as dist

        reused = dist.group.WORLD._get_backend(dev).last_staging_report().reused_slots
    return dict(losses=losses, shards=shards, stats=dict(tide.fsdp.stats), names=names,
                reused_slots=reused)


def _assert_close(a, b, atol, what):
    assert a.keys() == b.keys()
    for n in a:
        diff = (a[n].double() - b[n].double()).abs().max().item() if a[n].numel() else 0.0
        assert diff <= atol, f"{what}: {n} differs by {diff} > {atol}"


_gloo_runs: dict = {}


def _stock_on_gloo(ws, shard1=False):
    """Stock FSDP2 over gloo on CPU (cached: several tests compare against one run)."""
    if (ws, shard1) not in _gloo_runs:
        _gloo_runs[ws, shard1] = run_ranks(fsdp_worker, ws, "cpu", False,
                                           kwargs=dict(shard1=shard1), backend="gloo", timeout=300)
    return _gloo_runs[ws, shard1]


@pytest.mark.parametrize("ws, shard1", [(2, False), (4, True)])
def test_fsdp2_on_cuda_matches_stock_fsdp2_on_gloo(ws, shard1):
    """The same training on CPU with stock FSDP2 over gloo: only CPU vs GPU fp32 GEMM
    rounding separates them (stated bound 1e-4 after 3 SGD steps at lr 0.5)."""
    cuda = run_ranks(fsdp_worker, ws, "cuda", kwargs=dict(shard1=shard1), timeout=300)
    gloo = _stock_on_gloo(ws, shard1)
    for r in range(ws):
        stats = cuda[r]["stats"]
        assert stats["zero_copy_all_gather"] > 0 and stats["zero_copy_reduce_scatter"] > 0, stats
        assert stats["stock_all_gather"] == 0 and stats["stock_reduce_scatter"] == 0, stats
        _assert_close(cuda[r]["shards"], gloo[r]["shards"], 1e-4, f"rank {r} cuda tide vs gloo")
        assert max(abs(a - b) for a, b in zip(cuda[r]["losses"], gloo[r]["losses"])) < 1e-4


def test_fsdp2_bf16_on_cuda_matches_reference():
    """bf16 parameters (cast kernel into the storages), bf16 gradients reduced into fp32
    shards, against stock FSDP2 in fp32 over gloo: bf16 rounding bounds it (1e-2)."""
    cuda = run_ranks(fsdp_worker, 2, "cuda", kwargs=dict(bf16=True), timeout=300)
    gloo = _stock_on_gloo(2)
    for r in range(2):
        stats = cuda[r]["stats"]
        assert stats["zero_copy_reduce_scatter"] > 0 and stats["zero_copy_all_gather"] > 0, stats
        assert stats["stock_all_gather"] == 0 and stats["stock_reduce_scatter"] == 0, stats
        _assert_close(cuda[r]["shards"], gloo[r]["shards"], 1e-2, f"rank {r} bf16 vs fp32")


def test_slot_reuse_on_cuda_stages_in_vacated_storage():
    """TIDE_SLOT_REUSE=1: unsharded storages from the symmetric pool, the reduce-scatter's
    staging in pool memory the all-gathers vacated; the same training as stock on gloo."""
    cuda = run_ranks(fsdp_worker, 2, "cuda", kwargs=dict(slot_reuse=True), timeout=300)
    gloo = _stock_on_gloo(2)
    for r in range(2):
        assert cuda[r]["reused_slots"], f"rank {r}: no staging slot was reused"
        _assert_close(cuda[r]["shards"], gloo[r]["shards"], 1e-4, f"rank {r} slot-reuse vs gloo")


def test_no_layout_copies_in_a_cuda_step():
    copies = {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat"}
    res = run_ranks(fsdp_worker, 2, "cuda", kwargs=dict(profile=True), timeout=300)
    assert res[0]["names"], "the profiler saw nothing"
    assert not copies & res[0]["names"], f"layout copies in a tide CUDA step: {copies & res[0]['names']}"
