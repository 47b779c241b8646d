"""A tide group over several nodes, on one machine split into pseudo-nodes
(TIDE_LOCAL_WORLD_SIZE): real ranks, the real inter-node engine (torch's gloo), shared
memory only within a node (checked: ranks of different nodes map no common memfd). What
runs across nodes today: every standard collective on CPU tensors (gloo runs them), and
FSDP2 with TIDE-AG across nodes (the two-level schedule: gloo between nodes, node peers'
storages within) and FSDP2's stock reduce-scatter, bitwise equal to stock FSDP2 on a gloo
group."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks


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


@pytest.mark.parametrize("ws,local,nodes", [(4, 2, 2), (3, 1, 3), (6, 3, 2)])
def test_standard_collectives_across_pseudo_nodes(monkeypatch, ws, local, nodes):
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", str(local))
    results = run_ranks(collectives_worker, ws, nodes)
    flat = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not flat, "\n".join(flat)
    assert_memory_stays_in_nodes([inodes for _, inodes in results], local)


def test_one_pseudo_node_is_the_host_transport(monkeypatch):
    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "2")
    assert run_ranks(_one_node_worker, 2) == [(1, True)] * 2


def _one_node_worker(rank, ws):
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device("cpu")).num_nodes(), bool(tide_mappings())


@pytest.mark.parametrize("ws,local", [(4, 2), (6, 2), (6, 3), (3, 1)])
def test_fsdp2_across_pseudo_nodes_matches_stock_on_gloo(monkeypatch, ws, local):
    """FSDP2 on pseudo-nodes: TIDE-AG across nodes (gloo between them, node peers within),
    the stock reduce-scatter (one warning says why); fp32 parameters bitwise equal to stock
    FSDP2 on a gloo group; the inter-node bytes went through the engine; no layout copy of
    the all-gather in the profiler."""
    from test_fsdp_zero_copy import assert_params_equal, train_worker

    monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", str(local))
    tide = run_ranks(_pseudo_node_train_worker, ws)
    gloo = run_ranks(train_worker, ws, False, backend="gloo")
    for r in range(ws):
        stats, warned = tide[r]["stats"], tide[r]["warned"]
        assert stats["zero_copy_all_gather"] > 0 and stats["stock_all_gather"] == 0, stats
        assert stats["stock_reduce_scatter"] > 0, stats
        assert any(f"spans {ws // local} nodes" in w and "reduce-scatter" in w for w in warned), warned
        assert tide[r]["inter_node_bytes"] > 0
        # TIDE_DEBUG names the path of each level and the engine
        assert f"across {ws // local} nodes: inter-node over gloo" in tide[r]["log"], tide[r]["log"]
        assert "reduce-scatter: stock FSDP2 path" in tide[r]["log"], tide[r]["log"]
        copies = {n for n in tide[r]["names"] if "all_gather_copy_in" in n or "split_with_sizes_copy" in n}
        assert not copies, copies
    assert tide[0]["losses"] == gloo[0]["losses"]
    assert_params_equal(tide[0]["params"], gloo[0]["params"], f"tide over {ws // local} pseudo-nodes vs stock on gloo")
    assert_memory_stays_in_nodes([t["inodes"] for t in tide], local)


def _pseudo_node_train_worker(rank, ws):
    import warnings

    import torch.distributed as dist

    from test_fsdp_zero_copy import train_worker

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_worker(rank, ws, True, profile=True, debug_log=True)
    result["warned"] = [str(w.message) for w in caught if "tide" in str(w.message)]
    result["inter_node_bytes"] = dist.group.WORLD._get_backend(torch.device("cpu")).inter_node_bytes_sent()
    result["inodes"] = memfd_inodes()
    return result
