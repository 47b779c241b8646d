"""Every collective of the tide backend, every dtype and reduce op, at world sizes 1-4.

Each rank makes every rank's inputs from a seed (so any rank can compute the reference
locally), runs the tide collective, and checks it against a float64 reference (exact for
integers and bool), and fp32 sums also bitwise against an fp32 sum in rank order (what tide
promises) and against gloo run on the same data in the same processes.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks

FLOAT_TYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_TYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ALL_TYPES = FLOAT_TYPES + INT_TYPES + [torch.bool]
# Documented tolerances: bf16/fp16 results are fp32 sums rounded once, so they may differ
# from a float64 reference rounded to bf16/fp16 by one unit in the last place.
TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12),
       torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 1e-3)}
BITWISE = ["band", "bor", "bxor"]
OPS = ["sum", "avg", "max", "min", "product", "premul_sum"] + BITWISE
SIZES = [0, 1, 7, 1000, 300_001]  # 300_001 x 8 bytes spans several staging chunks


def make_input(seed: int, rank: int, numel: int, dtype: torch.dtype, op: str = "sum"):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype in INT_TYPES and op in BITWISE:  # every bit pattern of the type
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (numel,), generator=g, dtype=dtype)
    if dtype in INT_TYPES:
        # Small values: products and sums of up to 4 ranks stay inside every int type.
        lo, hi = (1, 3) if op == "product" else (0, 20)
        return torch.randint(lo, hi, (numel,), generator=g).to(dtype)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    if op == "product":
        x = 0.5 + x.abs()  # keeps products of 4 values in range for fp16
    return x.to(dtype)


def reduce_op(op: str, factor: float):
    return {
        "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
        "premul_sum": dist._make_nccl_premul_sum(factor), "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
    }[op]


def reference(inputs, op: str, factor: float, out_dtype: torch.dtype):
    """The reduction in float64 (int64 for integers, logic for bool), cast to out_dtype."""
    if op in BITWISE:
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        return functools.reduce(fn, inputs)
    if inputs[0].dtype == torch.bool:
        stack = torch.stack(inputs)
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    if inputs[0].dtype in INT_TYPES:
        s = torch.stack([x.long() for x in inputs])
        r = {"sum": lambda: s.sum(0), "max": lambda: s.max(0).values, "min": lambda: s.min(0).values,
             "product": lambda: s.prod(0),
             "avg": lambda: torch.div(s.sum(0), len(inputs), rounding_mode="trunc")}[op]()
        return r.to(out_dtype)
    s = torch.stack([x.double() for x in inputs])
    r = {"sum": lambda: s.sum(0), "avg": lambda: s.sum(0) / len(inputs), "max": lambda: s.max(0).values,
         "min": lambda: s.min(0).values, "product": lambda: s.prod(0),
         "premul_sum": lambda: (s * factor).sum(0)}[op]()
    return r.to(out_dtype)


def check(failures, what, got, want):
    if got.dtype in TOL:
        rtol, atol = TOL[got.dtype]
        ok = torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(got, want)
    if not ok:
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0
        failures.append(f"{what}: mismatch (max abs diff {diff})")


def valid(dtype, op):
    if op in BITWISE:
        return dtype == torch.bool or dtype in INT_TYPES
    if dtype == torch.bool:
        return op in ("sum", "max", "min", "product")
    if dtype in INT_TYPES:
        return op != "premul_sum"
    return True


def cases():
    seed = 0
    for dtype in ALL_TYPES:
        for op in OPS:
            if not valid(dtype, op):
                continue
            for numel in SIZES:
                if numel == 300_001 and dtype not in (torch.float32, torch.bfloat16):
                    continue
                seed += 1
                yield seed, dtype, op, numel


def reduction_worker(rank, ws):
    """all_reduce, reduce, reduce_scatter(_tensor) for every case; returns failures."""
    failures = []
    factor = 0.37
    for seed, dtype, op, numel in cases():
        tag = f"ws={ws} {dtype} {op} n={numel}"
        ins = [make_input(seed, r, numel, dtype, op) for r in range(ws)]
        want = reference(ins, op, factor, dtype)

        t = ins[rank].clone()
        dist.all_reduce(t, op=reduce_op(op, factor))
        check(failures, f"all_reduce {tag}", t, want)

        root = ws - 1
        t = ins[rank].clone()
        dist.reduce(t, dst=root, op=reduce_op(op, factor))
        check(failures, f"reduce {tag}", t, want if rank == root else ins[rank])

        # reduce_scatter_tensor: rank r's input is ws slices; slice s goes to rank s. Each slice
        # has its own seed, so a rank makes its own ws slices and only slice `rank` of the others.
        def rs_slice(r, s):
            return make_input((seed + 7) * 16 + s, r, numel, dtype, op)

        rs_mine = [rs_slice(rank, s) for s in range(ws)]
        rs_want = reference([rs_slice(r, rank) for r in range(ws)], op, factor, dtype)
        out = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.cat(rs_mine), op=reduce_op(op, factor))
        check(failures, f"reduce_scatter_tensor {tag}", out, rs_want)

        out = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter(out, rs_mine, op=reduce_op(op, factor))
        check(failures, f"reduce_scatter {tag}", out, rs_want)

        if dtype == torch.float32 and op == "sum":
            # tide sums in rank order 0..ws-1: bitwise equal to that fp32 sum everywhere.
            ordered = functools.reduce(torch.add, ins)
            t = ins[rank].clone()
            dist.all_reduce(t)
            if not torch.equal(t, ordered):
                failures.append(f"all_reduce {tag}: not bitwise equal to the rank-order fp32 sum")
    return failures


def mixed_precision_worker(rank, ws):
    """bf16/fp16 in, fp32 out: accumulated in fp32, against float64; sums also through
    tide.reduce_scatter_tensor_mixed, which must make torch warn about nothing (2.13 and
    2.14 deprecate reduce_scatter_tensor)."""
    import warnings

    import tide

    failures = []
    for dtype in (torch.bfloat16, torch.float16):
        for op in ("sum", "avg", "premul_sum"):
            for numel in (1, 1001, 300_001):
                ins = [make_input(numel, r, numel * ws, dtype) for r in range(ws)]
                want = reference(ins, op, 0.25, torch.float64).chunk(ws)[rank]
                out = torch.full((numel,), float("nan"))
                if op == "sum":
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        tide.reduce_scatter_tensor_mixed(out, ins[rank])
                    failures += [f"reduce_scatter_tensor_mixed warned: {w.message}" for w in caught]
                else:
                    dist.reduce_scatter_tensor(out, ins[rank], op=reduce_op(op, 0.25))
                if not torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5):
                    failures.append(f"mixed reduce_scatter {dtype}->fp32 {op} n={numel}: "
                                    f"max diff {(out.double() - want).abs().max().item()}")
    return failures


def data_movement_worker(rank, ws):
    """all_gather (list and tensor), broadcast, gather, scatter, all_to_all, send/recv."""
    failures = []
    gloo = dist.new_group(backend="gloo")
    for seed, dtype in enumerate(ALL_TYPES):
        for numel in (0, 1, 13, 300_001 if dtype == torch.float32 else 1000):
            tag = f"ws={ws} {dtype} n={numel}"
            ins = [make_input(seed * 100 + numel, r, numel, dtype) for r in range(ws)]

            out = torch.empty(numel * ws, dtype=dtype)
            dist.all_gather_into_tensor(out, ins[rank])
            check(failures, f"all_gather_into_tensor {tag}", out, torch.cat(ins))

            outs = [torch.empty(numel, dtype=dtype) for _ in range(ws)]
            dist.all_gather(outs, ins[rank])
            for r in range(ws):
                check(failures, f"all_gather[{r}] {tag}", outs[r], ins[r])

            if dtype == torch.float32:  # gloo, same processes, same data
                g_out = torch.empty(numel * ws, dtype=dtype)
                dist.all_gather_into_tensor(g_out, ins[rank], group=gloo)
                check(failures, f"all_gather vs gloo {tag}", out, g_out)

            root = 1 % ws
            t = ins[rank].clone()
            dist.broadcast(t, src=root)
            check(failures, f"broadcast {tag}", t, ins[root])

            glist = [torch.empty(numel, dtype=dtype) for _ in range(ws)] if rank == root else None
            dist.gather(ins[rank], gather_list=glist, dst=root)
            if rank == root:
                for r in range(ws):
                    check(failures, f"gather[{r}] {tag}", glist[r], ins[r])

            out = torch.empty(numel, dtype=dtype)
            scatter_ins = [make_input(seed + 5, r, numel, dtype) for r in range(ws)]
            dist.scatter(out, scatter_list=scatter_ins if rank == root else None, src=root)
            check(failures, f"scatter {tag}", out, scatter_ins[rank])

            # all_to_all_single, equal splits: rank r's slice s goes to rank s.
            a2a = [make_input(seed + 9, r, numel * ws, dtype) for r in range(ws)]
            out = torch.empty(numel * ws, dtype=dtype)
            dist.all_to_all_single(out, a2a[rank])
            want = torch.cat([a2a[s].chunk(ws)[rank] if numel else a2a[s] for s in range(ws)])
            check(failures, f"all_to_all_single {tag}", out, want)

        # all_to_all_single with uneven splits: rank s sends (s + d + 1) rows to rank d.
        send_splits = [rank + d + 1 for d in range(ws)]
        recv_splits = [s + rank + 1 for s in range(ws)]
        rows = [make_input(seed + 11, s, sum(s + d + 1 for d in range(ws)) * 3, dtype).view(-1, 3)
                for s in range(ws)]
        out = torch.empty(sum(recv_splits), 3, dtype=dtype)
        dist.all_to_all_single(out, rows[rank], recv_splits, send_splits)
        want = torch.cat([rows[s].split([s + d + 1 for d in range(ws)])[rank] for s in range(ws)])
        check(failures, f"all_to_all_single uneven ws={ws} {dtype}", out, want)

        # all_to_all with lists of differently sized tensors.
        ins_l = [make_input(seed + 13, rank * ws + d, d + rank + 2, dtype) for d in range(ws)]
        outs_l = [torch.empty(rank + s + 2, dtype=dtype) for s in range(ws)]
        dist.all_to_all(outs_l, ins_l)
        for s in range(ws):
            check(failures, f"all_to_all[{s}] ws={ws} {dtype}", outs_l[s],
                  make_input(seed + 13, s * ws + rank, rank + s + 2, dtype))

    # send/recv around a ring, twice, with tags.
    if ws > 1:
        for step in range(2):
            nxt, prv = (rank + 1) % ws, (rank - 1) % ws
            mine = make_input(500 + step, rank, 777, torch.float32)
            got = torch.empty(777)
            if rank % 2 == 0:
                dist.send(mine, nxt, tag=step)
                dist.recv(got, prv, tag=step)
            else:
                dist.recv(got, prv, tag=step)
                dist.send(mine, nxt, tag=step)
            check(failures, f"send/recv ring step {step} ws={ws}", got,
                  make_input(500 + step, prv, 777, torch.float32))
    dist.barrier()
    return failures


def noncontiguous_worker(rank, ws):
    """Strided inputs and outputs are handled (copied), not rejected."""
    failures = []
    base = make_input(3, rank, 64, torch.float32).view(8, 8)
    t = base.t()  # non-contiguous
    want = reference([make_input(3, r, 64, torch.float32).view(8, 8).t() for r in range(ws)],
                     "sum", 1.0, torch.float32)
    dist.all_reduce(t)
    check(failures, "all_reduce non-contiguous", t, want)
    out = torch.empty(8 * ws, 2).t()  # non-contiguous output, (2, 8 * ws)
    inp = make_input(4, rank, 16, torch.float32).view(2, 8)
    dist.all_gather_into_tensor(out, inp)
    # Flat view of what the caller passed: ws blocks of the inputs in rank order.
    want = torch.cat([make_input(4, r, 16, torch.float32) for r in range(ws)])
    check(failures, "all_gather_into_tensor non-contiguous output", out.reshape(-1), want)
    # all_to_all with strided inputs of 0, 1 and 3 elements (contiguous() keeps the stride
    # of a 0- or 1-element tensor: found by tests/python/test_gloo_fuzz.py).
    size = [[0, 1, 3][(a + b) % 3] for a in range(ws) for b in range(ws)]  # a <-> b, by a * ws + b
    ins = [make_input(5 + r, rank, 2 * size[rank * ws + r], torch.float32)[::2] for r in range(ws)]
    outs = [torch.empty(size[rank * ws + r]) for r in range(ws)]
    dist.all_to_all(outs, ins)
    for r in range(ws):
        check(failures, f"all_to_all strided input from rank {r}", outs[r],
              make_input(5 + rank, r, 2 * outs[r].numel(), torch.float32)[::2])
    return failures


def async_worker(rank, ws):
    """async_op=True returns Work objects with futures, completing in issue order."""
    failures = []
    xs = [make_input(10 + i, rank, 1000, torch.float32) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    futs = [w.get_future() for w in works]
    for i, (w, f) in enumerate(zip(works, futs)):
        w.wait()
        want = reference([make_input(10 + i, r, 1000, torch.float32) for r in range(ws)],
                         "sum", 1.0, torch.float32)
        check(failures, f"async all_reduce {i}", xs[i], want)
        check(failures, f"async future value {i}", f.value()[0], want)
        if not w.is_completed() or not w.is_success():
            failures.append(f"work {i} not completed/successful after wait")
    return failures


def coalesced_worker(rank, ws):
    """The coalesced variants, through torch's own _coalescing_manager."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    failures = []
    sizes = [5, 1000, 33]
    ins = [[make_input(70 + i, r, n, torch.float32) for r in range(ws)] for i, n in enumerate(sizes)]
    ts = [ins[i][rank].clone() for i in range(len(sizes))]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for i, t in enumerate(ts):
        check(failures, f"coalesced all_reduce {i}", t, reference(ins[i], "sum", 1.0, torch.float32))

    outs = [torch.empty(n * ws) for n in sizes]
    with _coalescing_manager(async_ops=True) as cm:
        for i, out in enumerate(outs):
            dist.all_gather_into_tensor(out, ins[i][rank])
    cm.wait()
    for i, out in enumerate(outs):
        check(failures, f"coalesced all_gather_into_tensor {i}", out, torch.cat(ins[i]))

    rs_in = [[make_input(90 + i, r, n * ws, torch.bfloat16) for r in range(ws)]
             for i, n in enumerate(sizes)]
    outs = [torch.empty(n) for n in sizes]  # bf16 in, fp32 out, coalesced
    with _coalescing_manager(async_ops=True) as cm:
        for i, out in enumerate(outs):
            dist.reduce_scatter_tensor(out, rs_in[i][rank])
    cm.wait()
    for i, out in enumerate(outs):
        want = reference(rs_in[i], "sum", 1.0, torch.float64).chunk(ws)[rank].float()
        check(failures, f"coalesced reduce_scatter_tensor {i}", out, want)
    return failures


def multi_tensor_worker(rank, ws):
    """broadcast and allreduce with several tensors per call (gloo's form), against gloo on
    the same data and against a reference."""
    failures = []
    gloo = dist.new_group(backend="gloo")
    tide_pg = dist.group.WORLD
    for seed, (dtype, op, k) in enumerate([(torch.float32, "sum", 3), (torch.int32, "max", 2),
                                           (torch.int64, "bxor", 4), (torch.bool, "bor", 2),
                                           (torch.float64, "product", 2), (torch.int16, "min", 3)]):
        tag = f"ws={ws} {dtype} {op} k={k}"
        ins = [[make_input(seed * 10 + i, r, 513, dtype, op) for i in range(k)] for r in range(ws)]
        flat = [t for per_rank in ins for t in per_rank]
        want = reference(flat, op, 1.0, dtype)
        opts = dist.AllreduceOptions()
        opts.reduceOp = reduce_op(op, 1.0)
        mine = [t.clone() for t in ins[rank]]
        tide_pg.allreduce(mine, opts).wait()
        for i in range(k):
            check(failures, f"multi-tensor allreduce {tag} tensor {i}", mine[i], want)
        if dtype not in (torch.bool, torch.int16):  # gloo has no reductions for these
            theirs = [t.clone() for t in ins[rank]]
            gloo.allreduce(theirs, opts).wait()
            for i in range(k):
                check(failures, f"multi-tensor allreduce vs gloo {tag} tensor {i}", mine[i], theirs[i])
        bopts = dist.BroadcastOptions()
        bopts.rootRank, bopts.rootTensor = ws - 1, k - 1
        mine = [t.clone() for t in ins[rank]]
        tide_pg.broadcast(mine, bopts).wait()
        for i in range(k):
            check(failures, f"multi-tensor broadcast {tag} tensor {i}", mine[i], ins[ws - 1][k - 1])
    # The built-in backends' wording, with tide's detail.
    errors = {}
    backend = tide_pg._get_backend(torch.device("cpu"))  # an empty list never leaves torch's dispatcher
    for what, call in {"empty": lambda: backend.broadcast([], dist.BroadcastOptions()),
                       "root": lambda: tide_pg.broadcast([torch.ones(2)], _bopts(ws + 2))}.items():
        try:
            call()
            errors[what] = None
        except Exception as e:  # noqa: BLE001
            errors[what] = str(e)
    if not errors["empty"] or "requires non-empty tensor list" not in errors["empty"]:
        failures.append(f"empty list: {errors['empty']}")
    if not errors["root"] or "invalid root rank" not in errors["root"] or f"rank {rank}" not in errors["root"]:
        failures.append(f"bad root: {errors['root']}")
    return failures


def _bopts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


WORKERS = [reduction_worker, multi_tensor_worker, coalesced_worker, mixed_precision_worker, data_movement_worker,
           noncontiguous_worker, async_worker]


@pytest.mark.parametrize("ws", [1, 2, pytest.param(3, marks=pytest.mark.one_torch),
                                pytest.param(4, marks=pytest.mark.one_torch)])
@pytest.mark.parametrize("worker", WORKERS, ids=lambda f: f.__name__)
def test_collectives_match_reference(worker, ws):
    failures = run_ranks(worker, ws, timeout=300)
    flat = [f"rank {r}: {msg}" for r, fs in enumerate(failures) for msg in fs]
    assert not flat, "\n".join(flat[:40])


# ---- torch's batch_isend_irecv: grouped sends and receives --------------------------------------

def _p2p_message(src, dst, i):
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + i)
    return [torch.randn(3_000_000, generator=g),  # 12 MB: far beyond a host channel ring
            torch.randn(7, 5, generator=g).to(torch.bfloat16),
            torch.randint(-5, 5, (0,), generator=g)][i]


def batch_p2p_worker(rank, ws, strided):
    """Every rank sends three messages to each ring neighbour, then receives them (with
    `strided`, one into a non-contiguous tensor, which gloo refuses), all in one
    batch_isend_irecv; each message is the one its sender was seeded with. Sent one at a
    time, the 12 MB ones deadlock on the host transport."""
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    ops, got = [], []
    for to in (nxt, prv):
        for i in range(3):
            ops.append(dist.P2POp(dist.isend, _p2p_message(rank, to, i), to, tag=i))
    for frm in (prv, nxt):
        for i in range(3):
            want = _p2p_message(frm, rank, i)
            buf = torch.empty(5, 7, dtype=want.dtype).t() if i == 1 and strided else torch.empty_like(want)
            got.append((frm, i, buf))
            ops.append(dist.P2POp(dist.irecv, buf, frm, tag=i))
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
        w.get_future().wait()
    wrong = [(frm, i) for frm, i, buf in got if not torch.equal(buf, _p2p_message(frm, rank, i))]
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return dict(wrong=wrong, works=len(works), coalescing=backend.supports_coalescing)


@pytest.mark.parametrize("nodes", [1, 3])
def test_batch_isend_irecv_around_a_ring(monkeypatch, nodes):
    """3 ranks on one node (the host transport: the batch progresses as one group) and on
    three pseudo-nodes (gloo's sends and receives, one Work for the batch)."""
    if nodes == 3:
        monkeypatch.setenv("TIDE_LOCAL_WORLD_SIZE", "1")
    for rank, out in enumerate(run_ranks(batch_p2p_worker, 3, nodes == 1, timeout=120, pg_timeout_s=30)):
        assert out["coalescing"] and out["works"] == 1, (rank, out)
        assert not out["wrong"], f"rank {rank}: wrong messages (from rank, index): {out['wrong']}"
