"""A tide group over several nodes, on one machine split into pseudo-nodes
(TIDE_LOCAL_WORLD_SIZE): real ranks, the real inter-node engine (torch's gloo), shared
memory only within a node (checked: ranks of different nodes map no common memfd). What
runs across nodes today: every standard collective on CPU tensors (gloo runs them), and
FSDP2 with TIDE-AG (the two-level schedule: gloo between nodes, node peers' storages
within) and TIDE-RS (node-local partials, then gloo along each rail) across nodes,
bitwise equal to stock FSDP2 with a reduce-scatter that sums in TIDE-RS's documented
order."""
from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_ranks


def private_dev_shm(rank):
    """Puts this rank in a mount namespace of its own with an empty tmpfs on /dev/shm (so no
    name there can be shared with another rank), marked with one file."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 1 << 18
    for ok, what in ((lambda: libc.unshare(clone_newns), "unshare(CLONE_NEWNS)"),
                     (lambda: libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "make / private"),
                     (lambda: libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None), "mount /dev/shm")):
        if ok() != 0:
            raise OSError(ctypes.get_errno(), f"rank {rank}: {what} failed")
    open(f"/dev/shm/private-to-rank-{rank}", "w").close()


def can_unshare_mounts():
    import shutil
    import subprocess

    return bool(shutil.which("unshare")) and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


def tide_mappings():
    with open("/proc/self/maps") as f:
        return [line.split()[-2] for line in f if "memfd:tide" in line]


def memfd_inodes():
    """The tide memfds this process maps, by inode (unique per memfd)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:tide" in line}


def assert_memory_stays_in_nodes(inodes, local):
    for a, ia in enumerate(inodes):
        for b, ib in enumerate(inodes):
            if a // local != b // local:
                assert not ia & ib, f"ranks {a} and {b} (different nodes) map the same memfds {ia & ib}"
            elif a != b and local > 1:
                assert ia & ib, f"ranks {a} and {b} (one node) share no memory"


def collectives_worker(rank, ws, want_nodes):
    import torch.distributed as dist

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    failures = []
    if backend.num_nodes() != want_nodes:
        failures.append(f"{backend.num_nodes()} nodes, want {want_nodes}")
    # The engines between the nodes: gloo for CPU tensors; for CUDA ones the NCCL delegate,
    # which a machine without a GPU does not have (then the CUDA path says so).
    if backend.why_not_across_nodes() or backend.inter_node_engine() != "gloo":
        failures.append(f"CPU across nodes: {backend.why_not_across_nodes()!r}, "
                        f"engine {backend.inter_node_engine()!r}")
    cuda_why = backend.why_not_across_nodes(0)
    if not torch.cuda.is_available() and "NCCL" not in cuda_why and "without CUDA" not in cuda_why:
        failures.append(f"CUDA across nodes without a GPU: {cuda_why!r}")

    def inp(seed, r, n, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed * 101 + r)
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)

    def same(what, got, want, exact=True):
        ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(), atol=1e-5)
        if not ok:
            failures.append(f"{what}: {got[:4].tolist()} vs {want[:4].tolist()}")

    x = inp(1, rank, 1001)
    dist.all_reduce(x)
    same("all_reduce", x, sum(inp(1, r, 1001).double() for r in range(ws)).float(), exact=False)
    out = torch.empty(ws * 37)
    dist.all_gather_into_tensor(out, inp(2, rank, 37))
    same("all_gather_into_tensor", out, torch.cat([inp(2, r, 37) for r in range(ws)]))
    rs = torch.empty(13)
    dist.reduce_scatter_tensor(rs, inp(3, rank, 13 * ws))
    same("reduce_scatter_tensor", rs,
         sum(inp(3, r, 13 * ws).double() for r in range(ws))[rank * 13:(rank + 1) * 13].float(),
         exact=False)
    b = inp(4, rank, 64, torch.bfloat16)
    dist.broadcast(b, src=ws - 1)
    same("broadcast", b, inp(4, ws - 1, 64, torch.bfloat16))
    outs = [torch.empty(5, dtype=torch.int64) for _ in range(ws)]
    dist.all_gather(outs, torch.arange(5, dtype=torch.int64) + 10 * rank)
    same("all_gather", torch.cat(outs), torch.cat([torch.arange(5) + 10 * r for r in range(ws)]))
    dist.barrier()
    return failures, memfd_inodes()


@pytest.mark.parametrize("ws,local,nodes", [(4, 2, 2), pytest.param(3, 1, 3, marks=pytest.mark.one_torch),
                                            pytest.param(6, 3, 2, marks=pytest.mark.one_torch)])
def test_standard_collectives_across_pseudo_nodes(monkeypatch, ws, local, nodes):
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", str(local))
    results = run_ranks(collectives_worker, ws, nodes)
    flat = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not flat, "\n".join(flat)
    assert_memory_stays_in_nodes([inodes for _, inodes in results], local)


def gloo_work_in_flight_worker(rank, ws):
    """Leaves all-gathers running on the group's gloo delegate, their handles dropped, for
    the harness's destroy_process_group: gloo's run loop then frees each finished work's
    Python-owned tensors, which takes the GIL."""
    import torch.distributed as dist

    outs = [torch.empty(1 << 20) for _ in range(ws)]
    for _ in range(4):
        dist.all_gather(outs, torch.randn(1 << 20), async_op=True)
    return True


def test_destroying_the_group_with_gloo_work_in_flight_does_not_hang(monkeypatch):
    # The group's teardown drops the gloo delegate, whose destructor waits for its run loop:
    # it must not hold the GIL meanwhile (it did, and every rank hung in destroy_process_group).
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "1")
    assert run_ranks(gloo_work_in_flight_worker, 2, timeout=60) == [True, True]


def test_one_pseudo_node_is_the_host_transport(monkeypatch):
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "2")
    assert run_ranks(_one_node_worker, 2) == [(1, True)] * 2


def _one_node_worker(rank, ws):
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device("cpu")).num_nodes(), bool(tide_mappings())


def documented_order_reduce_scatter(local):
    """FSDP2's reduce-scatter for a reference run (FSDP2's own set_custom_reduce_scatter
    hook): every rank's input gathered exactly, then summed in torch, fp32, in the order
    TIDE-RS documents across nodes of `local` ranks: each node's ranks in order into a
    partial, then the partials in node order."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class DocumentedOrder(DefaultReduceScatter):
        calls = 0

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            assert input_tensor.dtype == torch.float32 and not async_op, (input_tensor.dtype, async_op)
            ws, rank = group.size(), group.rank()
            everyone = torch.empty(ws * input_tensor.numel(), dtype=torch.float32)
            dist.all_gather_into_tensor(everyone, input_tensor.contiguous(), group=group)
            inputs = everyone.view(ws, -1)
            total = None
            for node in range(ws // local):
                partial = inputs[node * local].clone()
                for r in range(node * local + 1, (node + 1) * local):
                    partial += inputs[r]
                total = partial if total is None else total + partial
            if op == dist.ReduceOp.AVG:
                total /= ws
            else:
                assert op == dist.ReduceOp.SUM, op
            output_tensor.copy_(total.view(ws, -1)[rank].view_as(output_tensor))
            DocumentedOrder.calls += 1
            return None

    return DocumentedOrder()


def _reference_train_worker(rank, ws, local, bf16):
    """Stock FSDP2 (tide's zero-copy path off) with the documented-order reduce-scatter."""
    from test_fsdp_zero_copy import train_worker

    rs = documented_order_reduce_scatter(local)
    result = train_worker(rank, ws, False, bf16=bf16, custom_reduce_scatter=rs)
    result["reference_calls"] = type(rs).calls
    return result


@pytest.mark.parametrize("ws,local,bf16,private_shm", [
    (4, 2, False, False), pytest.param(6, 2, False, False, marks=pytest.mark.one_torch),
    pytest.param(6, 3, False, False, marks=pytest.mark.one_torch), (3, 1, False, False),
    (4, 2, True, False), pytest.param(6, 3, True, False, marks=pytest.mark.one_torch),
    # one rank per node: bf16 node partials between the nodes
    pytest.param(3, 1, True, False, marks=pytest.mark.one_torch),
    # each rank in its own mount namespace with a private /dev/shm
    pytest.param(4, 2, False, True, marks=pytest.mark.one_torch),
])
def test_fsdp2_across_pseudo_nodes_matches_the_documented_order(monkeypatch, ws, local, bf16, private_shm):
    """FSDP2 on pseudo-nodes with TIDE-AG and TIDE-RS across nodes (gloo between them, node
    peers within): parameters bitwise equal to stock FSDP2 whose reduce-scatter sums in
    TIDE-RS's documented order (stock FSDP2 on gloo, which all-gathers bf16 parameters too);
    the inter-node bytes went through the
    engine; no layout copy in the profiler; memory shared only within a node. Where mount
    namespaces can be made (root, as in CI), one case puts every rank in its own namespace
    with a private /dev/shm."""
    from test_fsdp_zero_copy import AG_COPIES, RS_COPIES, assert_params_equal

    if private_shm and not can_unshare_mounts():
        pytest.skip("mount namespaces cannot be made here (needs root / CAP_SYS_ADMIN)")
    nodes = ws // local
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", str(local))
    tide = run_ranks(_pseudo_node_train_worker, ws, bf16, before_init=private_dev_shm if private_shm else None)
    monkeypatch.delenv("TIDE_LOCAL_WORLD_SIZE")
    ref = run_ranks(_reference_train_worker, ws, local, bf16, backend="gloo")
    for r in range(ws):
        stats = tide[r]["stats"]
        assert stats["zero_copy_all_gather"] > 0 and stats["stock_all_gather"] == 0, stats
        assert stats["zero_copy_reduce_scatter"] > 0 and stats["stock_reduce_scatter"] == 0, stats
        assert not tide[r]["warned"], tide[r]["warned"]
        assert tide[r]["inter_node_bytes"] > 0
        assert ref[r]["reference_calls"] > 0
        # TIDE_DEBUG names the path of each level and the engine
        log = tide[r]["log"]
        assert f"all-gather: zero-copy on cpu, across {nodes} nodes: inter-node over gloo" in log, log
        assert f"reduce-scatter: zero-copy on cpu, across {nodes} nodes: node-local into node partials, " \
               "inter-node over gloo" in log, log
        copies = tide[r]["names"] & (AG_COPIES | RS_COPIES)
        assert not copies, copies
        if private_shm:
            assert tide[r]["dev_shm"] == [f"private-to-rank-{r}"], tide[r]["dev_shm"]
    assert tide[0]["losses"] == ref[0]["losses"]
    assert_params_equal(tide[0]["params"], ref[0]["params"],
                        f"tide over {nodes} pseudo-nodes vs stock with the documented sum order")
    assert_memory_stays_in_nodes([t["inodes"] for t in tide], local)


def test_hsdp_across_pseudo_nodes_matches_stock_on_gloo(monkeypatch):
    """HSDP on 2 pseudo-nodes x 2 ranks, shard groups inside the nodes and replicate groups
    across them (as HSDP is deployed): TIDE-AG and TIDE-RS on the shard groups, the replicate
    all-reduce over gloo between the nodes, every second micro-batch (partial sums kept in
    between); bitwise equal to stock FSDP2 HSDP on gloo (every sum has two terms here, so
    any order gives the same bits). The replicate groups are sub-groups whose ranks sit on
    different pseudo-nodes: they must share no memory."""
    from test_fsdp_zero_copy import assert_params_equal, train_worker

    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "2")
    tide = run_ranks(_pseudo_node_train_worker, 4, False, True)
    monkeypatch.delenv("TIDE_LOCAL_WORLD_SIZE")
    gloo = run_ranks(train_worker, 4, False, kwargs=dict(hsdp=True, accumulate=True), backend="gloo")
    for r in range(4):
        stats = tide[r]["stats"]
        assert stats["zero_copy_all_gather"] > 0 and stats["stock_all_gather"] == 0, stats
        assert stats["zero_copy_reduce_scatter"] > 0 and stats["stock_reduce_scatter"] == 0, stats
        assert not tide[r]["warned"], tide[r]["warned"]
        assert "HSDP all-reduce over the 2-rank replicate group" in tide[r]["log"], tide[r]["log"]
    assert tide[0]["losses"] == gloo[0]["losses"]
    assert_params_equal(tide[0]["params"], gloo[0]["params"], "HSDP over 2 pseudo-nodes vs stock on gloo")
    assert_memory_stays_in_nodes([t["inodes"] for t in tide], 2)


def _pseudo_node_train_worker(rank, ws, bf16=False, hsdp=False):
    import warnings

    import torch.distributed as dist

    from test_fsdp_zero_copy import train_worker

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_worker(rank, ws, True, bf16=bf16, profile=True, debug_log=True, hsdp=hsdp,
                              accumulate=hsdp)
    result["warned"] = [str(w.message) for w in caught if "tide" in str(w.message)]
    result["inter_node_bytes"] = dist.group.WORLD._get_backend(torch.device("cpu")).inter_node_bytes_sent()
    result["inodes"] = memfd_inodes()
    result["dev_shm"] = sorted(os.listdir("/dev/shm"))
    return result


def _direct_reduce_scatter_worker(rank, ws, local):
    """One TIDE-RS called on the backend directly (shapes that split evenly: no padding):
    the bytes this rank's engine sent, and its shard against a float64 reference."""
    import torch.distributed as dist

    import tide

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    plan = tide._C.plan
    shapes = [(ws * 40, 33), (ws * 7,), (ws * 3, 5, 4)]
    layout = plan.plan_group([plan.Param(list(s), 2, 0) for s in shapes], ws)

    def grads_of(r):
        g = torch.Generator().manual_seed(100 + r)
        return [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]

    padded = [lp.padded_shard_numel for lp in layout.params]
    out = torch.full((sum(padded),), float("nan"))
    before = backend.inter_node_bytes_sent()
    backend.param_reduce_scatter(layout, grads_of(rank), out, [sum(padded[:i]) for i in range(len(padded))],
                                 dist.ReduceOp.SUM).wait()
    sent = backend.inter_node_bytes_sent() - before
    want = torch.cat([sum(grads_of(r)[i].double() for r in range(ws)).reshape(ws, -1)[rank]
                      for i in range(len(shapes))])
    return dict(sent=sent, numel=sum(lp.numel for lp in layout.params),
                direct=backend.last_staging_report().direct_bytes,
                max_err=(out.double() - want).abs().max().item())


@pytest.mark.parametrize("ws,local", [(4, 2), pytest.param(6, 2, marks=pytest.mark.one_torch), (3, 1)])
def test_reduce_scatter_traffic_matches_the_model(monkeypatch, ws, local):
    """The step-time model's TIDE-RS NIC bytes per rank (tide_reducescatter_traffic: the node
    partials of the other nodes' rail ranks: fp32, bf16 at one rank per node) equal what the
    engine sent; with one rank per node every byte of it goes straight from the gradients
    (no copy into a node partial)."""
    from tide.bench import model as M

    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", str(local))
    for r, got in enumerate(run_ranks(_direct_reduce_scatter_worker, ws, local)):
        want = M.tide_reducescatter_traffic(local, ws // local, got["numel"], 2, 4)["net_bytes"]
        assert got["sent"] == want, (r, got["sent"], want)
        assert got["direct"] == (want if local == 1 else 0), (r, got["direct"], want)
        assert got["max_err"] < 1e-4, got["max_err"]


def _dead_peer_across_nodes_worker(rank, ws, collective):
    """Rank 1 (the other node) exits once the model is sharded; rank 0 runs a step, or a
    standard op (the gloo delegate's), waited on and through its future."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if collective == "all_reduce":
        dist.all_reduce(torch.ones(8))  # both alive
        if rank == 1:
            os._exit(0)
        errors = []
        for wait in (lambda w: w.wait(), lambda w: w.get_future().wait()):
            try:
                wait(dist.all_reduce(torch.ones(8), async_op=True))
            except Exception as e:  # noqa: BLE001
                errors.append((type(e).__name__, str(e)))
        return errors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for layer in model:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    if collective == "reduce-scatter":
        model(torch.randn(4, 64)).sum()  # the all-gathers done while the peer lives
    if rank == 1:
        os._exit(0)
    try:
        model(torch.randn(4, 64)).sum().backward()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("collective", ["all-gather", "reduce-scatter", "all_reduce"])
def test_a_dead_peer_across_nodes_is_named(monkeypatch, collective):
    """A peer on another node dies: the survivor's inter-node exchange fails with torch's
    DistBackendError naming the engine and the peer (the engines once moved the failed
    exchange away before formatting its peers: "with ranks  failed"); a standard op, which
    gloo runs, with DistBackendError naming the op and the rank (gloo's own is a bare
    RuntimeError), from Work.wait() and from its future."""
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "1")
    result = run_ranks(_dead_peer_across_nodes_worker, 2, collective, expect_exit={1}, pg_timeout_s=20)[0]
    if collective == "all_reduce":
        assert len(result) == 2, result
        for kind, msg in result:
            assert kind == "DistBackendError", (kind, msg)
            assert msg.startswith("tide allreduce: rank 0: across 2 nodes, gloo"), msg
        return
    kind, msg = result
    assert kind == "DistBackendError", (kind, msg)
    assert "inter-node exchange over gloo with ranks 1 failed" in msg, msg


def _split_worker(rank, ws):
    """dist.split_group on 2 x 2 pseudo-nodes: splits inside the nodes, across them, and one
    that leaves two ranks out; each split's all_reduce against its members' seeded tensors
    summed in float64."""
    import torch.distributed as dist

    def mine(r, salt):
        return torch.randn(1000, generator=torch.Generator().manual_seed(100 * salt + r))

    out = {}
    for salt, splits in enumerate(([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3]])):
        group = dist.split_group(split_ranks=splits)
        members = next((s for s in splits if rank in s), None)
        if members is None:
            out[salt] = ("not a member", group is dist.GroupMember.NON_GROUP_MEMBER)
            continue
        backend = group._get_backend(torch.device("cpu"))
        t = mine(rank, salt)
        dist.all_reduce(t, group=group)
        want = sum(mine(r, salt).double() for r in members)
        # Two members: their fp32 sum is the float64 one rounded, bit for bit.
        out[salt] = (type(backend).__name__, backend.num_nodes(), torch.equal(t, want.float()))
    return out


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15),
                    reason=f"torch {torch.__version__}'s split_group splits only CUDA groups (it needs a device "
                           "bound to the default group); from 2.15 it splits CPU groups too")
def test_split_group_makes_tide_groups_that_keep_their_nodes(monkeypatch):
    """dist.split_group (ProcessGroupTide::split) gives tide groups whose ranks keep their
    pseudo-nodes: a split inside a node runs on its host transport, one across nodes on gloo
    between them (tide once refused to split: "its backend does not support splitting")."""
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "2")
    for rank, out in enumerate(run_ranks(_split_worker, 4)):
        assert out[0] == ("ProcessGroupTide", 1, True), (rank, out)
        assert out[1] == ("ProcessGroupTide", 2, True), (rank, out)
        if rank in (0, 3):
            assert out[2] == ("ProcessGroupTide", 2, True), (rank, out)
        else:
            assert out[2] == ("not a member", True), (rank, out)
