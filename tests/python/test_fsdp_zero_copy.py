"""FSDP2 on a tide group: the zero-copy path against stock FSDP2 (on gloo and on tide),
a single-process reference, the profiler (no layout copies) and the staging accounting."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from real_models import assert_params_equal

STEPS = 3
# SGD, not Adam: Adam turns rounding-level differences of near-zero gradients into
# full-size steps, which would hide what these tests compare.


def small_config():
    from tide.models import LlamaConfig

    # Odd vocab and FFN widths: uneven shards and padding at every world size.
    return LlamaConfig(vocab_size=61, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=93,
                       max_seq_len=32)


class AwkwardModel(nn.Module):
    """TinyLlama plus a head with a parameter smaller than the world size (1 row)."""

    def __init__(self):
        super().__init__()
        from tide.models import TinyLlama

        self.llama = TinyLlama(small_config())
        self.score = nn.Linear(48, 1)  # weight (1, 48), bias (1,): empty shards on most ranks

    def forward(self, tokens):
        # Each module runs once per forward: torch 2.11's CommDebugMode breaks on a module
        # called twice (it leaks the first call's forward hook; fixed in later torch).
        logits = self.llama(tokens)
        return logits + self.score(logits[..., :48]).mean()


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def batch(step, rank):
    from tide.models import make_batch

    return make_batch(small_config(), 4, 16, step, rank)


def train_worker(rank, ws, zero_copy, bf16=False, shard1=False, accumulate=False,
                 reshard=True, profile=False, hsdp=False, divide_factor=None,
                 explicit_unshard=False, slot_reuse=False, debug_log=False, late_install=False,
                 comm_debug=False, custom_reduce_scatter=None):
    """Trains AwkwardModel with FSDP2 on the default group; returns losses and full params
    (with profile=True, the profiler's event names of the last step, and with debug_log=True
    also its events in order and what TIDE_DEBUG printed during it)."""
    import contextlib
    import io
    import os

    os.environ["TIDE_SLOT_REUSE"] = "1" if slot_reuse else "0"
    os.environ["TIDE_DEBUG"] = "1" if debug_log else "0"
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    import tide.fsdp

    if not zero_copy or late_install:
        tide.fsdp.uninstall()
    torch.manual_seed(0)
    model = AwkwardModel()
    mesh = (init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (ws,)))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())

    def placement(p):
        return Shard(1) if shard1 and p.ndim == 2 and p.shape[1] % ws == 0 else None

    for layer in model.llama.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard,
                    shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if late_install:  # the param groups exist before TIDE is fitted into FSDP2
        assert tide.fsdp.install()
    if custom_reduce_scatter is not None:  # a reference's own reduce-scatter (FSDP2's hook)
        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(custom_reduce_scatter)
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    early_state = model.state_dict()  # taken before training: must follow the parameters
    losses, names, events, log = [], set(), [], io.StringIO()
    comm_counts, c10d_events = None, {}
    for step in range(STEPS):
        micro = 2 if accumulate else 1
        for m in range(micro):
            if accumulate:  # HSDP: reduce-scatter every micro-batch, all-reduce the sum at the last
                (model.set_requires_all_reduce if hsdp else model.set_requires_gradient_sync)(m == micro - 1)
            last = step == STEPS - 1
            prof = torch.profiler.profile() if profile and last else None
            comm = None
            if comm_debug and last:
                from torch.distributed.tensor.debug import CommDebugMode

                comm = CommDebugMode()
            with contextlib.ExitStack() as stack:
                if prof:
                    stack.enter_context(prof)
                if comm:
                    stack.enter_context(comm)
                if debug_log and last:
                    stack.enter_context(contextlib.redirect_stdout(log))
                if explicit_unshard:
                    model.unshard()  # FSDP2's explicit unshard, before forward asks for it
                loss = loss_of(model, batch(step * micro + m, rank))
                loss.backward()
            if prof:
                names |= {e.name for e in prof.events()}
                events += [e.name for e in prof.events()]
                for e in prof.events():
                    if e.name.startswith("c10d::"):
                        c10d_events[e.name] = c10d_events.get(e.name, 0) + 1
            if comm:
                comm_counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    early = {n: t.full_tensor() for n, t in early_state.items()}
    stale = [n for n in params if not torch.equal(early[n], params[n])]
    staging = dist.group.WORLD._get_backend(torch.device("cpu"))
    report = staging.last_staging_report() if zero_copy and hasattr(staging, "last_staging_report") else None
    algorithm = staging.host_allgather_algorithm() if zero_copy and hasattr(
        staging, "host_allgather_algorithm") else None
    return dict(losses=losses, params=params, names=names, stats=dict(tide.fsdp.stats),
                by_group={k: dict(v) for k, v in tide.fsdp.stats_by_group.items()},
                events=events if debug_log else None, log=log.getvalue(),
                comm_counts=comm_counts, c10d_events=c10d_events,
                stale_state_dict=stale, algorithm=algorithm,
                staging=(report.slot_bytes * report.num_slots, report.reused_slots) if report else None)


def reference_worker(rank, _ws, ws):
    """One process, the full model, every rank's batch: the mean loss over ranks' batches
    has the same gradient as FSDP2's averaged reduce-scatter."""
    torch.manual_seed(0)
    model = AwkwardModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        loss = sum(loss_of(model, batch(step, r)) for r in range(ws)) / ws
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_zero_copy_ran(results, all_gather=True, reduce_scatter=True):
    """Parity with stock proves nothing if tide silently fell back to stock: on every rank,
    every param group's collectives of each kind asked for took TIDE's path (the stock count
    is zero)."""
    for rank, result in enumerate(results):
        stats, groups = result["stats"], result["by_group"]
        for kind, wanted in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter)):
            if not wanted:
                continue
            assert stats[f"zero_copy_{kind}"] > 0 and stats[f"stock_{kind}"] == 0, (rank, stats)
            for name, counts in groups.items():
                assert counts[f"zero_copy_{kind}"] > 0, (rank, name, counts)


@pytest.mark.parametrize("ws", [2, 3])
def test_fp32_zero_copy_is_bitwise_equal_to_stock_fsdp2_on_tide(ws):
    """Same reductions in the same order: the zero-copy path must give the same bits."""
    zc = run_ranks(train_worker, ws, True)
    stock = run_ranks(train_worker, ws, False)
    assert_zero_copy_ran(zc)
    assert stock[0]["stats"]["zero_copy_all_gather"] == 0
    assert not zc[0]["stale_state_dict"], "a state_dict taken before training went stale"
    assert_params_equal(zc[0]["params"], stock[0]["params"], f"ws={ws} zero-copy vs stock on tide")
    assert zc[0]["losses"] == stock[0]["losses"]


def test_fp32_matches_stock_fsdp2_on_gloo():
    """At 2 ranks a + b is the same in any order, so tide equals gloo bit for bit."""
    zc = run_ranks(train_worker, 2, True)
    gloo = run_ranks(train_worker, 2, False, backend="gloo")
    assert_zero_copy_ran(zc)
    assert_params_equal(zc[0]["params"], gloo[0]["params"], "tide zero-copy vs stock on gloo")


def test_collectives_are_visible_to_comm_debug_mode_and_the_profiler():
    """FSDP2's own tests count collectives with CommDebugMode; users profile. A zero-copy
    step shows the same c10d collectives, as many, as stock FSDP2 on gloo."""
    zc = run_ranks(train_worker, 2, True, kwargs=dict(comm_debug=True, profile=True))
    gloo = run_ranks(train_worker, 2, False, backend="gloo", kwargs=dict(comm_debug=True, profile=True))
    assert_zero_copy_ran(zc)
    for r in range(2):
        counts = zc[r]["comm_counts"]
        assert counts.get("c10d._allgather_base_", 0) > 0, counts
        assert counts.get("c10d._reduce_scatter_base_", 0) > 0, counts
        assert counts == gloo[r]["comm_counts"], (counts, gloo[r]["comm_counts"])
        for op in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
            assert zc[r]["c10d_events"].get(op) == gloo[r]["c10d_events"].get(op), (
                zc[r]["c10d_events"], gloo[r]["c10d_events"])


def test_fp32_matches_single_process_reference():
    zc = run_ranks(train_worker, 3, True)
    ref = run_ranks(reference_worker, 1, 3, backend=None)[0]
    # Different summation order (3 ranks vs one batch of 3): fp32 rounding, bounded.
    assert_params_equal(zc[0]["params"], ref, "tide vs single process", atol=1e-5)


def test_bf16_mixed_precision_matches_reference():
    """bf16 params / fp32 reduce (stock FSDP2 cannot run this on gloo) vs an fp32 single
    process: bf16 rounding of params and activations bounds the difference (stated 1e-2
    after 3 SGD steps at lr 0.5)."""
    zc = run_ranks(train_worker, 2, True, True)
    assert_zero_copy_ran(zc)
    ref = run_ranks(reference_worker, 1, 2, backend=None)[0]
    assert_params_equal(zc[0]["params"], ref, "bf16 tide vs fp32 reference", atol=1e-2)
    stock = run_ranks(train_worker, 2, False, True)  # stock FSDP2 code path over tide
    assert_params_equal(zc[0]["params"], stock[0]["params"], "bf16 zero-copy vs stock on tide")


@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.one_torch)])
def test_shard_dim1_accumulation_and_no_reshard(ws):
    opts = dict(shard1=True, accumulate=True, reshard=False)
    zc = run_ranks(train_worker, ws, True, kwargs=opts)
    stock = run_ranks(train_worker, ws, False, kwargs=opts)
    assert_zero_copy_ran(zc)
    assert_params_equal(zc[0]["params"], stock[0]["params"], f"Shard(1)+accumulation ws={ws}")


@pytest.mark.parametrize("opts, stock_paths", [
    # post-forward mesh of 2: backward's all-gathers come from it, stock path
    (dict(reshard=2, divide_factor=8.0), {"stock_all_gather"}),
    # 2 x 2 mesh: TIDE-AG and TIDE-RS on the shard groups, then the replicate all-reduce;
    # with accumulation, the all-reduce only every second micro-batch (partial sums kept)
    (dict(hsdp=True, bf16=True), set()),
    (dict(hsdp=True, accumulate=True), set()),
    (dict(explicit_unshard=True, divide_factor=3.0), set()),
    # storages homed in shared memory; 4 KiB slots so the tiny layers do reuse them
    (dict(slot_reuse=True, accumulate=True, bf16=True), set()),
], ids=["reshard-int+divide-factor", "hsdp-bf16", "hsdp-accumulate", "explicit-unshard", "slot-reuse"])
def test_more_fsdp2_features_match_stock(opts, stock_paths, monkeypatch):
    if opts.get("slot_reuse"):
        monkeypatch.setenv("TIDE_SHM_SLOT_BYTES", "4096")
    zc = run_ranks(train_worker, 4, True, kwargs=opts)
    stock = run_ranks(train_worker, 4, False, kwargs=opts)
    stats = zc[0]["stats"]
    for path in stock_paths:
        assert stats[path] > 0, f"expected a stock {path} fallback: {stats}"
    assert_zero_copy_ran(zc, all_gather="stock_all_gather" not in stock_paths,
                         reduce_scatter="stock_reduce_scatter" not in stock_paths)
    if opts.get("slot_reuse"):
        assert zc[0]["staging"][1] > 0, f"no slot was reused: {zc[0]['staging']}"
    assert_params_equal(zc[0]["params"], stock[0]["params"], f"{opts}")


def test_recursive_doubling_all_gather_in_fsdp2_matches_stock(monkeypatch):
    """The inter-node algorithm (paced recursive doubling, 4 KiB rounds), run by the host
    transport inside bf16 FSDP2 training at a world size that is not a power of two: the
    same bits as FSDP2's stock path."""
    monkeypatch.setenv("TIDE_HOST_ALLGATHER", "doubling")
    monkeypatch.setenv("TIDE_ALLGATHER_PACE_BYTES", "4096")
    zc = run_ranks(train_worker, 3, True, True)
    monkeypatch.delenv("TIDE_HOST_ALLGATHER")
    stock = run_ranks(train_worker, 3, False, True)
    assert_zero_copy_ran(zc)
    assert zc[0]["algorithm"] == "doubling", zc[0]["algorithm"]  # equal bits prove nothing else
    assert_params_equal(zc[0]["params"], stock[0]["params"], "recursive doubling vs stock")
    assert zc[0]["losses"] == stock[0]["losses"]


# FSDP2's layout copies: the all-gather's copy-in and copy-out, and the reduce-scatter's
# copy-in (fsdp::chunk_cat up to torch 2.14, fsdp::chunk_cat_mixed_dtype from 2.15).
AG_COPIES = {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy"}
RS_COPIES = {"fsdp::chunk_cat", "fsdp::chunk_cat_mixed_dtype"}


def test_no_layout_copies_in_a_tide_step():
    zc = run_ranks(train_worker, 2, True, kwargs=dict(profile=True))
    stock = run_ranks(train_worker, 2, False, kwargs=dict(profile=True))
    assert AG_COPIES <= stock[0]["names"] and RS_COPIES & stock[0]["names"], \
        "the profiler must see stock FSDP2's copies"
    copies = AG_COPIES | RS_COPIES
    assert not copies & zc[0]["names"], f"layout copies in a tide step: {copies & zc[0]['names']}"
    assert "tide:param_all_gather" in zc[0]["names"]
    assert "tide:param_reduce_scatter" in zc[0]["names"]


def test_debug_log_names_the_zero_copy_path_for_every_collective():
    """bf16 mixed precision with TIDE_DEBUG=1: one "zero-copy" line for each all-gather and
    each reduce-scatter that FSDP2 itself issued in the step (counted from its own profiler
    ranges, FSDP::all_gather and FSDP::post_backward_reduce), and no stock path."""
    zc = run_ranks(train_worker, 2, True, True, kwargs=dict(profile=True, debug_log=True))
    for rank, result in enumerate(zc):
        events, log = result["events"], result["log"].splitlines()
        fsdp_all_gathers = sum(e.split(" (")[0] == "FSDP::all_gather" for e in events)
        fsdp_reduces = sum(e.split(" (")[0] == "FSDP::post_backward_reduce" for e in events)
        assert fsdp_all_gathers > 0 and fsdp_reduces > 0, sorted(set(events))[:20]
        assert sum("all-gather: zero-copy on cpu" in line for line in log) == fsdp_all_gathers, log
        assert sum("reduce-scatter: zero-copy on cpu" in line for line in log) == fsdp_reduces, log
        assert not [line for line in log if "stock" in line], f"rank {rank}: {log}"


def test_param_groups_made_before_tide_is_installed():
    """Up to torch 2.14 the copy-out is a module function, so groups made before
    `import tide` run TIDE-AG too; from 2.15 the copy-out is each group's own hook, which
    such a group does not have, so its all-gathers stay stock (the reduce-scatter, a module
    function, is TIDE's in both). Either way: stock FSDP2's bits."""
    import tide.fsdp

    late = run_ranks(train_worker, 2, True, kwargs=dict(late_install=True))
    stock = run_ranks(train_worker, 2, False)
    stats = late[0]["stats"]
    if tide.fsdp.generation() == "2.15":
        assert stats["zero_copy_all_gather"] == 0 and stats["stock_all_gather"] > 0, stats
        assert_zero_copy_ran(late, all_gather=False)
    else:
        assert_zero_copy_ran(late)
    assert_params_equal(late[0]["params"], stock[0]["params"], "groups made before install")


def mapped_bytes(label):
    """Bytes of /proc/self/maps mappings of the memfds labelled `label`."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if f"/memfd:{label} " in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def staging_worker(rank, ws, per_rank_rows, zero_copy=True):
    """A group whose per-rank output is fixed: rows = per_rank_rows * ws; Slot-Reuse on.
    Returns what the reduce-scatter's staging measurably took: tide's last staging report and
    the bytes of this rank's own shared segment (from /proc/self/maps: every rank maps all ws
    segments, one of them its own), or stock FSDP2's reduce-scatter input (the tensor it hands
    c10d::_reduce_scatter_base_, seen by a dispatch mode)."""
    import os

    os.environ["TIDE_SLOT_REUSE"] = "1"
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    import tide.fsdp

    class ReduceScatterInputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nbytes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket == torch.ops.c10d._reduce_scatter_base_:
                self.nbytes.append(args[1].numel() * args[1].element_size())
            return func(*args, **(kwargs or {}))

    if not zero_copy:
        tide.fsdp.uninstall()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, per_rank_rows * ws, bias=False),
                          nn.Linear(per_rank_rows * ws, 8, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    seen = ReduceScatterInputs()
    loss = model(torch.randn(4, 256)).sum()
    with seen:
        loss.backward()
    if not zero_copy:
        return dict(rs_input=max(seen.nbytes))
    report = dist.group.WORLD._get_backend(torch.device("cpu")).last_staging_report()
    return dict(staging=report.slot_bytes * report.num_slots, reused=report.reused_slots,
                slots=report.num_slots, fallback=report.fallback_bytes,
                own_segment=mapped_bytes("tide-host") // ws, rs_input=max(seen.nbytes))


@pytest.mark.one_torch
def test_reduce_scatter_staging_is_flat_in_world_size():
    """Fixed per-rank output (8 MiB of bf16 gradient per destination), measured at world
    sizes 2, 3, 4: stock FSDP2's fp32 reduce-scatter input grows with the world size; TIDE
    hands c10d none (zero-element tokens), reduces through its staging slots, which sit in
    the layer's vacated all-gather storage (Slot-Reuse), and its own shared segment (the
    fixed staging plus two p2p channels per peer) grows by far less than stock's input."""
    tide, stock = {}, {}
    for ws in (2, 3, 4):
        tide[ws] = run_ranks(staging_worker, ws, 16384)[0]
        stock[ws] = run_ranks(staging_worker, ws, 16384, False)[0]["rs_input"]
        t = tide[ws]
        assert t["reused"] == t["slots"] and t["fallback"] == 0, f"ws={ws}: {t}"
        assert t["rs_input"] == 0, f"ws={ws}: tide handed c10d a {t['rs_input']} B input"
        assert t["staging"] <= t["own_segment"] < stock[ws], f"ws={ws}: {t}, stock {stock[ws]}"
    per_rank = {ws: stock[ws] / ws for ws in stock}  # stock: ws x the per-rank output (+ padding)
    assert max(per_rank.values()) <= 1.01 * min(per_rank.values()), stock
    growth = tide[4]["own_segment"] - tide[2]["own_segment"]
    assert growth * 4 <= stock[4] - stock[2], (tide, stock)


def test_slot_reuse_falls_back_when_storage_is_too_small():
    # 2 rows per rank of 256 bf16: the vacated storage (KiB) cannot hold a 2 MiB slot.
    t = run_ranks(staging_worker, 2, 2)[0]
    assert t["reused"] == 0 and t["fallback"] > 0 and t["slots"] > 0, t


# ---- what a user asked for is done as asked ----------------------------------------------------
def custom_collectives_worker(rank, ws):
    """A user's own collectives that subclass FSDP2's defaults (to count, log or reorder):
    on a tide group they run as written, never replaced by TIDE's."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    import tide.fsdp

    calls = {"all_gather": 0, "reduce_scatter": 0}

    class CountingAllGather(DefaultAllGather):
        def __call__(self, *args, **kwargs):
            calls["all_gather"] += 1
            return super().__call__(*args, **kwargs)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            calls["reduce_scatter"] += 1
            return super().__call__(*args, **kwargs)

    torch.manual_seed(0)
    model = AwkwardModel()
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model.llama.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_custom_all_gather"):
            m.set_custom_all_gather(CountingAllGather())
            m.set_custom_reduce_scatter(CountingReduceScatter())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            loss_of(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    return dict(calls=calls, stats=dict(tide.fsdp.stats), params={n: p.full_tensor() for n, p in model.named_parameters()},
                warnings=[str(w.message) for w in caught if "tide" in str(w.message)])


def test_a_users_subclass_of_fsdp2s_default_collectives_runs_as_written():
    res = run_ranks(custom_collectives_worker, 2)
    stock = run_ranks(train_worker, 2, False, backend="gloo")
    for r in res:
        assert r["calls"]["all_gather"] > 0 and r["calls"]["reduce_scatter"] > 0, r["calls"]
        stats = r["stats"]
        assert stats["zero_copy_all_gather"] == 0 and stats["zero_copy_reduce_scatter"] == 0, stats
        assert any("CountingAllGather" in w for w in r["warnings"]), r["warnings"]
        assert any("CountingReduceScatter" in w for w in r["warnings"]), r["warnings"]
    # Two steps of the same training as stock's first two (the user's collectives are FSDP2's own).
    assert set(res[0]["params"]) == set(stock[0]["params"])


def async_unshard_worker(rank, ws, update):
    """FSDP2's explicit unshard(async_op=True), with or without an in-place update of the
    sharded parameters before its wait()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = AwkwardModel()
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    loss_of(model, batch(0, rank)).backward()  # lazy init and a first all-gather
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    handle = model.unshard(async_op=True)
    if update:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    try:
        handle.wait()
    except RuntimeError as e:
        return dict(error=str(e))
    unsharded = {n: p.detach().clone() for n, p in model.named_parameters()}  # unsharded views now
    model.reshard()
    return dict(error=None, equal=all(torch.equal(unsharded[n], full[n]) for n in full))


def test_updating_parameters_before_an_async_unshards_wait_is_an_error():
    """TIDE-AG reads each shard where it lives while the all-gather runs (stock FSDP2 copies
    it in at the call), so an update between unshard(async_op=True) and wait() would reach
    the peers half done: TIDE raises instead, naming the parameter. Without the update the
    async unshard delivers the full parameters."""
    ok = run_ranks(async_unshard_worker, 2, False)
    assert all(r["error"] is None and r["equal"] for r in ok), ok
    bad = run_ranks(async_unshard_worker, 2, True)
    for r in bad:
        assert r["error"] and "modified in place between unshard(async_op=True)" in r["error"], r
        assert "llama.tok_embeddings.weight" in r["error"] or "weight" in r["error"], r
