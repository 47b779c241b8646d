"""Property tests of the layout planner (tide._C.plan) against torch and FSDP2 itself.

Every test draws fresh random parameter groups (odd sizes, 1-D, fewer rows than ranks,
Shard(d > 0), world sizes 1..16) and checks the planner's addresses by moving real data:
shards from torch.chunk land at the all-gather addresses, gradients are reduced through the
reduce-scatter addresses and FSDP2's own copy-in (chunk_cat), the recursive-doubling
schedule is replayed byte by byte.
"""
import random

import pytest
import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce_scatter_copy_in
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    _chunk_with_empty,
    _get_dim0_padded_size,
    _get_dim_chunked_size,
)

import tide._C

P = tide._C.plan
DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]


def random_group(rng, ws, uneven_ok=False):
    """(shape, dtype, shard_dim) triples; with uneven_ok some Shard(d > 0) are uneven."""
    group = []
    for _ in range(rng.randint(1, 4)):
        shape = [0 if rng.random() < 0.08 else rng.randint(1, 11) for _ in range(rng.randint(1, 3))]
        dim = 0
        if len(shape) > 1 and rng.random() < 0.3:
            dim = rng.randint(1, len(shape) - 1)
            shape[dim] = ws * rng.randint(0, 3)
            if uneven_ok and ws > 1 and rng.random() < 0.5:
                shape[dim] += rng.randint(1, ws - 1)
        group.append((shape, rng.choice(DTYPES), dim))
    return group


def plan(group, ws):
    return P.plan_group([P.Param(s, d.itemsize, dim) for s, d, dim in group], ws)


def indices(pattern):
    """Element (or byte) indices of a Strided pattern, in pattern order."""
    starts = torch.arange(pattern.count, dtype=torch.long) * pattern.stride + pattern.offset
    return (starts[:, None] + torch.arange(pattern.run, dtype=torch.long)).reshape(-1)


def cat_indices(patterns):
    return torch.cat([indices(p) for p in patterns]) if patterns else torch.empty(0, dtype=torch.long)


def random_tensor(shape, dtype, gen):
    """Small integers: exact in every dtype, and sums of a few of them stay exact."""
    return torch.randint(0, 8, shape, generator=gen).to(dtype)


def fsdp2_padded_shard(full, ws, rank, dim):
    """FSDPParam._init_sharded_param: the rank's chunk, zero-padded to chunk 0's size."""
    chunks = _chunk_with_empty(full, ws, dim=dim)
    padded = full.new_zeros(chunks[0].size())
    if chunks[rank].numel() > 0:
        padded.narrow(dim, 0, chunks[rank].size(dim)).copy_(chunks[rank])
    return padded.view(-1)


def test_sharding_matches_fsdp2_helpers():
    rng = random.Random()
    for trial in range(3000):
        ws = rng.randint(1, 16)
        group = random_group(rng, ws, uneven_ok=True)
        if any(dim > 0 and s[dim] % ws for s, _, dim in group):
            with pytest.raises(RuntimeError, match=r"uneven sharding on dim \d .*world size"):
                plan(group, ws)
            continue
        layout = plan(group, ws)
        for (shape, dtype, dim), p in zip(group, layout.params):
            full = torch.empty(shape, device="meta")
            chunks = _chunk_with_empty(full, ws, dim=dim)
            assert p.padded_shard_numel == chunks[0].numel()
            assert p.storage_numel == ws * chunks[0].numel()  # init_all_gather_outputs
            assert p.storage_numel >= full.numel()
            begin = 0
            for r, s in enumerate(p.shards):
                assert s.sharded_size == list(_get_dim_chunked_size(chunks[r], full.size(), dim))
                assert s.padded_sharded_size == list(chunks[0].size())
                assert s.numel == chunks[r].numel()
                if chunks[r].numel() > 0:
                    assert s.begin == begin
                    begin += chunks[r].size(dim)


def test_allgather_addresses_rebuild_each_parameter():
    rng, gen = random.Random(), torch.Generator().manual_seed(random.getrandbits(32))
    for trial in range(2000):
        ws = rng.randint(1, 16)
        group = random_group(rng, ws)
        layout = plan(group, ws)
        fulls = [random_tensor(s, d, gen) for s, d, _ in group]
        storages = [torch.full((p.storage_numel,), 99, dtype=d) for p, (_, d, _) in zip(layout.params, group)]
        seen = [torch.zeros(p.storage_numel, dtype=torch.int32) for p in layout.params]
        for c in P.allgather_copies(layout):
            shape, _, dim = group[c.param]
            src = fsdp2_padded_shard(fulls[c.param], ws, c.src_rank, dim)
            dst = indices(c.dst)
            storages[c.param][dst] = src[: c.numel]
            seen[c.param][dst] += 1
        for (shape, _, dim), p, full, storage, hits in zip(group, layout.params, fulls, storages, seen):
            assert torch.equal(storage[: p.numel].view(shape), full)  # the unsharded view
            if dim > 0:
                assert torch.equal(storage.view(shape), full)
            assert torch.equal(hits[: p.numel], torch.ones(p.numel, dtype=torch.int32))
            assert not hits[p.numel :].any()  # padding never moves


def fsdp2_reduce_scatter(grads_per_rank, group, ws, reduce_dtype):
    """foreach_reduce's data path: chunk_cat copy-in per rank, sum, per-rank sharded views."""
    total = None
    for grads in grads_per_rank:
        grads = list(grads)
        for i, (_, _, dim) in enumerate(group):
            if dim > 0 and ws > 1:
                grads[i] = torch.cat(torch.chunk(grads[i], ws, dim=dim), dim=0)
        numel = sum(_get_dim0_padded_size(g.size(), ws).numel() for g in grads)
        rs_input = torch.empty(numel, dtype=reduce_dtype)
        # torch._chunk_cat refuses empty tensors; they take no room in the flat input anyway.
        if numel > 0:
            foreach_reduce_scatter_copy_in([g for g in grads if g.numel() > 0], rs_input, ws)
        total = rs_input if total is None else total + rs_input
    return total.view(ws, -1), numel


def test_reduce_scatter_addresses_match_fsdp2_foreach_reduce():
    rng, gen = random.Random(), torch.Generator().manual_seed(random.getrandbits(32))
    for trial in range(1000):
        ws = rng.randint(1, 16)
        group = [(s, torch.bfloat16, dim) for s, _, dim in random_group(rng, ws)]
        layout = plan(group, ws)
        grads = [[random_tensor(s, torch.bfloat16, gen) for s, _, _ in group] for _ in range(ws)]
        reduce_output, rs_numel = fsdp2_reduce_scatter(grads, group, ws, torch.float32)
        stock = P.stock_fsdp2_bytes(layout, reduce_elem_size=4)
        assert stock.rs_input == rs_numel * 4
        assert stock.ag_output == ws * sum(p.padded_shard_numel for p in layout.params) * 2

        mine = [[torch.full((s.numel,), -1.0) for s in p.shards] for p in layout.params]
        for sl in P.reduce_scatter_slices(layout):
            src = indices(sl.src)
            mine[sl.param][sl.dst_rank] = sum(g[sl.param].reshape(-1)[src].float() for g in grads)
        for d in range(ws):
            rank_output = reduce_output[d].clone()  # as rank d's own reduce_output tensor
            offset = 0  # foreach_reduce's flat_grad_offset
            for i, p in enumerate(layout.params):
                s = p.shards[d]
                ref = torch.as_strided(rank_output, s.sharded_size, make_contiguous_strides_for(s.sharded_size), offset)
                assert torch.equal(mine[i][d], ref.contiguous().view(-1)), (group[i], ws, d)
                whole = sum(g[i] for g in grads).float()
                assert torch.equal(mine[i][d], _chunk_with_empty(whole, ws, group[i][2])[d].reshape(-1))
                offset += p.padded_shard_numel


def test_rs_pipeline_reduces_into_fp32_shards():
    rng, gen = random.Random(), torch.Generator().manual_seed(random.getrandbits(32))
    for trial in range(300):
        ws = rng.randint(1, 16)
        group = [(s, torch.bfloat16, dim) for s, _, dim in random_group(rng, ws)]
        layout = plan(group, ws)
        max_inflight = rng.randint(1, 3)
        pipe = P.rs_pipeline(layout, chunk_bytes=4 * rng.randint(1, 40), max_inflight=max_inflight)
        grads = [[random_tensor(s, torch.bfloat16, gen) for s, _, _ in group] for _ in range(ws)]
        shards = [[torch.full((s.numel,), -1.0) for s in p.shards] for p in layout.params]
        slots = torch.full((ws, max(pipe.num_slots, 1), pipe.chunk_elems), float("nan"))
        for chunk in pipe.chunks:
            assert chunk.slot == chunk.id % max_inflight
            for pc in chunk.pieces:  # phase 1: read every rank's gradient into the slot
                n, src = pc.shard_end - pc.shard_begin, cat_indices(pc.grad)
                slots[pc.dst_rank, chunk.slot, pc.staging_offset : pc.staging_offset + n] = sum(
                    g[pc.param].reshape(-1)[src].float() for g in grads)
            for pc in chunk.pieces:  # phase 2: out of the slot into the fp32 shard
                n = pc.shard_end - pc.shard_begin
                shards[pc.param][pc.dst_rank][pc.shard_begin : pc.shard_end] = slots[
                    pc.dst_rank, chunk.slot, pc.staging_offset : pc.staging_offset + n]
            slots[:, chunk.slot] = float("nan")
        for i, (shape, _, dim) in enumerate(group):
            whole = sum(g[i] for g in grads).float()
            for d in range(ws):
                assert torch.equal(shards[i][d], _chunk_with_empty(whole, ws, dim)[d].reshape(-1))


def test_recursive_doubling_schedule_byte_level():
    rng, gen = random.Random(), torch.Generator().manual_seed(random.getrandbits(32))
    for trial in range(300):
        ws = rng.randint(1, 16)
        group = random_group(rng, ws)
        layout = plan(group, ws)
        pace = rng.choice([8, 24, 100, 1 << 20])
        sched = P.allgather_schedule(layout, pace)
        assert len(sched.steps) == (ws - 1).bit_length()
        fulls = [random_tensor(s, d, gen) for s, d, _ in group]
        full_bytes = [f.reshape(-1).view(torch.uint8) for f in fulls]
        # storage[r][i] (bytes) and how often each byte arrived at r
        storage = [[torch.zeros(p.storage_bytes(), dtype=torch.uint8) for p in layout.params] for _ in range(ws)]
        held = [[torch.zeros(p.storage_bytes(), dtype=torch.int32) for p in layout.params] for _ in range(ws)]
        for r in range(ws):  # each rank first places its own shard
            for i, p in enumerate(layout.params):
                b = indices(p.shards[r].placement.in_bytes(p.elem_size))
                storage[r][i][b] = full_bytes[i][b]
                held[r][i][b] += 1
        for k, step in enumerate(sched.steps):
            assert step.distance == 1 << k
            start = [[t.clone() for t in per_rank] for per_rank in storage]
            start_held = [[t.clone() for t in per_rank] for per_rank in held]
            for rnd in step.rounds:
                sent = {}
                for t in rnd.transfers:
                    p = layout.params[t.param]
                    assert t.dst_rank == (t.src_rank + step.distance) % ws
                    sent[t.src_rank] = sent.get(t.src_rank, 0) + (t.shard_end - t.shard_begin) * p.elem_size
                    b = cat_indices([s.in_bytes(p.elem_size) for s in t.storage])
                    assert (start_held[t.src_rank][t.param][b] == 1).all(), "sent before it was held"
                    storage[t.dst_rank][t.param][b] = start[t.src_rank][t.param][b]
                    held[t.dst_rank][t.param][b] += 1
                assert max(sent.values()) <= pace
        for r in range(ws):
            for i, p in enumerate(layout.params):
                real = p.numel * p.elem_size
                assert torch.equal(storage[r][i][:real], full_bytes[i]), (group, ws, r, i)
                assert (held[r][i][:real] == 1).all() and not held[r][i][real:].any()


def test_slot_reuse_and_accounting():
    rng = random.Random()
    for trial in range(200):
        ws = rng.choice([16, 32, 64])
        rows = rng.randint(1, 64)
        layout = P.plan_group([P.Param([rows * ws, 128], 2), P.Param([rows * ws], 2)], ws)
        pipe = P.rs_pipeline(layout, chunk_bytes=4096, max_inflight=3)
        assert pipe.staging_bytes() == min(3, len(pipe.chunks)) * min(4096, rows * 129 * 4)
        reuse = P.assign_staging_slots(P.storage_regions(layout), pipe.slot_bytes, pipe.num_slots, 256)
        ends = sorted((h.base_id, h.offset, h.offset + pipe.slot_bytes) for h in reuse.slots if h.reused)
        for (b0, _, e0), (b1, s1, _) in zip(ends, ends[1:]):
            assert b0 != b1 or e0 <= s1
        for h in reuse.slots:
            assert h.offset % 256 == 0
            if h.reused:
                assert h.offset + pipe.slot_bytes <= layout.params[h.base_id].storage_bytes()
        stock = P.stock_fsdp2_bytes(layout, reduce_elem_size=4, orig_elem_size=4)
        tide_ = P.tide_bytes(layout, rank=0, staging_bytes=reuse.fallback_bytes, reduce_elem_size=4, orig_elem_size=4)
        assert stock.rs_input == ws * rows * 129 * 4
        assert tide_.collective() == rows * 129 * 4 + reuse.fallback_bytes
        assert tide_.collective() < stock.collective()
