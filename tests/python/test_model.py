"""The cluster step-time / memory model (python/tide/bench/model.py, docs/model.md).

Components against hand-computed cases, monotonicity in every bandwidth and rate, the
planner's byte accounting (when tide._C is built). The host transport's model against a
measurement is a benchmark (benchmarks/host_model_check.py), not a test: timing on a shared
machine proves nothing.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_model():
    try:
        return importlib.import_module("tide.bench.model")
    except ImportError:
        # tide/__init__ imports tide._C; without a build, load the model as a plain file
        # (it imports its sibling modules directly then).
        path = ROOT / "python" / "tide" / "bench" / "model.py"
        spec = importlib.util.spec_from_file_location("tide_bench_model_standalone", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


M = _load_model()
HW = M.hwmod
WL = M.wlmod
GB = 1e9


def no_latency(hw):
    return hw.replace(nvlink_latency_us=0.0, rdma_latency_us=0.0)


# ---- collectives by hand ----------------------------------------------------------------

def test_ring_one_node_by_hand():
    hw = no_latency(HW.H100)
    S = 1e9
    t = M.ring_collective(hw, 8, S)["time"]
    assert t == pytest.approx(S * 7 / 8 / (370 * GB))


def test_ring_multi_node_by_hand():
    hw = no_latency(HW.H100)
    S = 1e9
    r = M.ring_collective(hw, 16, S)
    assert r["nvl"] == pytest.approx(S * 15 / 16 / (370 * GB))
    assert r["net"] == pytest.approx(S * (1 / 2) / 8 / (46 * GB))  # each NIC: half of a GPU's share
    assert r["time"] == pytest.approx(max(r["nvl"], r["net"]))
    # Fewer NICs than GPUs: the network term scales up.
    hw4 = hw.replace(nics_per_node=4)
    assert M.ring_collective(hw4, 16, S)["net"] == pytest.approx(2 * r["net"])


def test_tide_allgather_and_reducescatter_by_hand():
    hw = no_latency(HW.H100)
    S = 1e9
    assert M.tide_allgather(hw, 8, S)["time"] == pytest.approx(S * 7 / 8 / (370 * GB))
    opt = M.Options(world_size=64)
    n = 10**9
    rs = M.tide_reducescatter(hw, 64, n, opt)
    assert rs["nvl"] == pytest.approx(n * 2 * 7 / 8 / (370 * GB))
    assert rs["net"] == pytest.approx(n / 8 * 4 * 7 / 8 / (46 * GB))
    acc = n * 2 + n / 8 * 4 + 8 * n / 64 * 4 + n / 64 * 4
    assert rs["acc_bytes"] == pytest.approx(acc)
    assert rs["acc"] == pytest.approx(acc / (hw.hbm_copy_GBps * GB))
    assert rs["time"] == pytest.approx(max(rs["nvl"], rs["net"], rs["acc"]))
    assert M.ring_collective(hw, 1, S)["time"] == 0.0


# ---- interference and overlap ---------------------------------------------------------------

def test_wave_slowdown():
    assert M.gemm_wave_slowdown(132, 132, 16) == 2.0  # one full wave becomes two
    assert M.gemm_wave_slowdown(100, 132, 16) == 1.0  # still fits in the free SMs
    assert M.gemm_wave_slowdown(264, 132, 16) == 1.5  # 2 waves -> 3
    assert M.gemm_wave_slowdown(264, 132, 0) == 1.0
    assert M.single_wave_slowdown_pct(HW.H100) == pytest.approx(100.0)


def test_overlapped():
    assert M.overlapped(10.0, 1.0, 5.0) == 10.0
    assert M.overlapped(10.0, 2.0, 4.0) == pytest.approx(4.0 + 8.0)  # 2 units done while held
    assert M.overlapped(10.0, 2.0, 30.0) == pytest.approx(20.0)  # held for the whole compute


# ---- a single unit on one node, nothing to overlap ------------------------------------------

@pytest.mark.parametrize("impl", M.IMPLS)
def test_single_unit_one_node_step_by_hand(impl):
    hw = no_latency(HW.H200_MEASURED)
    ws, tokens, d = 8, 4096, 4096
    wl = WL.single_unit([(d, d)], tokens, d)
    opt = M.Options(world_size=ws)
    res = M.simulate(impl, wl, hw, opt)
    hbm = hw.hbm_copy_GBps * GB
    numel = d * d
    U = numel * 2  # unsharded bf16 bytes (d divides by ws: no padding)
    F = 2.0 * tokens * d * d / (hw.gemm_bf16_TFLOPs * 1e12)
    B = 2 * F
    opt_t = numel / ws * 28 / hbm
    if impl == "tide":
        ag = U * 7 / 8 / (hw.nvlink_ce_GBps * GB)
        acc = numel * 2 + numel / 8 * 4  # one node: no cross-node term
        t_acc = acc / hbm
        rs = max(numel * 2 * 7 / 8 / (hw.nvlink_ce_GBps * GB), t_acc)
        # AG exposed twice (forward, and the backward prefetch during the head's empty stage),
        # F, recompute + B, the accumulate kernel's GPU time, the exposed RS tail.
        want = 2 * ag + F + (F + B) + max(t_acc, rs) + opt_t
    else:
        bw = hw.nvlink_nccl_GBps if impl == "stock" else hw.nvlink_ce_GBps
        ag = U * 7 / 8 / (bw * GB)
        rs = numel * 8 / 8 * 4 * 7 / 8 / (hw.nvlink_nccl_GBps * GB)  # fp32 input ws x shard
        copy_in = 2 * numel / 8 * 2 / hbm
        copy_out = 2 * U / hbm
        chunk_cat = (numel * 2 + numel * 4) / hbm
        want = 2 * (copy_in + ag) + 2 * copy_out + F + (F + B) + max(chunk_cat, rs) + opt_t
    assert res["step_s"] == pytest.approx(want, rel=1e-9)
    b = res["breakdown"]
    assert b["interference"] == 0.0  # nothing overlaps compute here
    assert b["compute"] == pytest.approx(F + F + B)


def test_latency_is_negligible_at_fsdp_unit_sizes():
    opt = M.Options(world_size=64)
    wl = WL.llama31_70b()
    a = M.simulate("stock", wl, HW.H100, opt)["step_s"]
    b = M.simulate("stock", wl, no_latency(HW.H100), opt)["step_s"]
    assert abs(a - b) / a < 1e-3


# ---- monotonicity ---------------------------------------------------------------------------

FIELDS = ["hbm_copy_GBps", "gemm_bf16_TFLOPs", "attn_TFLOPs", "nvlink_nccl_GBps",
          "nvlink_ce_GBps", "rdma_GBps"]


@pytest.mark.parametrize("name", sorted(WL.WORKLOADS))
def test_more_bandwidth_is_never_slower(name):
    wl = WL.WORKLOADS[name]()
    for ws in (16, 64):
        opt = M.Options(world_size=ws)
        for impl in M.IMPLS:
            for f in FIELDS:
                prev = math.inf
                for k in (0.5, 1.0, 1.5, 2.0, 4.0):
                    hw = HW.H100.replace(**{f: getattr(HW.H100, f) * k})
                    t = M.simulate(impl, wl, hw, opt)["step_s"]
                    assert t <= prev * (1 + 1e-12), (impl, f, k, ws)
                    prev = t


def test_fewer_sms_held_is_never_slower():
    wl = WL.llama31_70b()
    opt = M.Options(world_size=64)
    prev = math.inf
    for ctas in (64, 32, 16, 8, 0):
        t = M.simulate("stock", wl, HW.H100.replace(nccl_ctas=ctas), opt)["step_s"]
        assert t <= prev
        prev = t


def test_tide_never_slower_here_and_orders():
    res = M.run_all(HW.PRESETS[HW.DEFAULT], M.Options(world_size=64))
    for w in res["workloads"].values():
        s = w["step_s"]
        assert s["tide"] <= s["symm"] <= s["stock"] * (1 + 1e-12)
        assert w["layout_share_pct"]["tide"] == 0.0
        p = w["peak_GiB"]
        assert w["peak_GiB_tide_slot_reuse"] <= p["tide"] <= p["stock"] <= p["symm"]


# ---- memory ---------------------------------------------------------------------------------

def test_rs_buffer_vs_world_size():
    opt = M.Options()
    out = 256 << 20
    stock = [M.rs_buffer_bytes("stock", out, w, opt) for w in (16, 32, 64)]
    tide = [M.rs_buffer_bytes("tide", out, w, opt) for w in (16, 32, 64)]
    assert stock == [16 * out, 32 * out, 64 * out]
    assert tide == [8 << 20] * 3  # two 4 MiB slots, whatever the world size
    assert M.rs_buffer_bytes("tide", out, 64, M.Options(slot_reuse=True)) == 0
    # A small output needs one slot of its own size.
    assert M.rs_buffer_bytes("tide", 1 << 20, 64, opt) == 1 << 20


def test_stock_bytes_by_hand():
    # (10, 3) over 4 ranks: chunk 3 rows -> padded shard 9, shards 9, 1 row... (3,3,3,1 rows)
    b = M.stock_bytes([(10, 3), (5,)], 4, elem_size=2, reduce_elem_size=4, orig_elem_size=4)
    padded = 3 * 3 + 2
    assert b.ag_input == padded * 2
    assert b.ag_output == 4 * padded * 2 == b.param_storage
    assert b.rs_input == 4 * padded * 4
    assert b.rs_output == padded * 4
    t = M.tide_bytes([(10, 3), (5,)], 4, rank=3, staging=0)
    assert t.rs_output == (1 * 3 + 0) * 4  # rank 3: one row of the first, nothing of (5,)
    assert M.shard_param((5,), 4).shard_numels == [2, 2, 1, 0]


# ---- calibration and the CLI -------------------------------------------------------------------

def test_calibrate_replaces_presets(tmp_path):
    res = {"device": "NVIDIA H200", "hbm_copy_GBps": 4000, "gemm_bf16_TFLOPs": 395.0,
           "nvlink_GBps": 300.0, "rdma_GBps": 40, "accumulate_GBps": 2000, "allgather_ce_GBps": 410,
           "something_else": 1}
    hw, extras = HW.calibrate(HW.H200, res)
    assert hw.hbm_copy_GBps == 4000.0 and hw.gemm_bf16_TFLOPs == 395.0
    assert hw.nvlink_nccl_GBps == 300.0 and hw.nvlink_ce_GBps == 410.0 and hw.rdma_GBps == 40.0
    assert extras == {"accumulate_GBps": 2000.0}
    assert hw.measured["ignored_keys"] == ["something_else"]
    assert hw.attn_TFLOPs == HW.H200.attn_TFLOPs  # not in the file: preset kept
    wl = WL.llama31_70b()
    f_pre, _ = M.compute_times(wl.blocks[0], HW.H200)
    f_cal, _ = M.compute_times(wl.blocks[0], hw)
    gemm = wl.blocks[0].gemm_flops
    assert f_cal - f_pre == pytest.approx(gemm / 395e12 - gemm / 790e12)
    with pytest.raises(ValueError):
        HW.calibrate(HW.H200, {"rdma_GBps": 0})
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"results": {"gemm_bf16_TFLOPs": 500}}))
    hw2, _ = HW.load_calibration(str(p), HW.H200)
    assert hw2.gemm_bf16_TFLOPs == 500.0


def test_cli_writes_outputs(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"device": "test", "hbm_copy_GBps": 4300}))
    assert M.main(["--out", str(tmp_path), "--calibrate", str(cal)]) == 0
    text = capsys.readouterr().out
    for needle in ("-27.1%", "6.4%", "+69%", "12.5-14.5x", "nearly constant", "-4.7 GiB"):
        assert needle in text
    for f in ("model.json", "model.txt", "model_step_breakdown.png", "model_rs_buffer.png"):
        assert (tmp_path / f).stat().st_size > 0
    data = json.loads((tmp_path / "model.json").read_text())
    assert set(data["workloads"]) == set(WL.WORKLOADS)
    assert data["hardware"]["measured"]["hbm_copy_GBps"] == 4300.0


def test_workload_sizes_match_model_cards():
    assert WL.llama31_70b().numel / 1e9 == pytest.approx(70.55, abs=0.05)
    assert WL.qwen3_30b_a3b().numel / 1e9 == pytest.approx(30.5, abs=0.1)
    assert WL.wan22_14b().numel / 1e9 == pytest.approx(14.3, abs=0.3)


# ---- the planner's byte accounting (tide._C.plan) --------------------------------------------

def _planner():
    try:
        from tide import _C  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"tide._C not importable ({type(e).__name__}: {e}); build it to compare "
                    "the model's bytes with tide._C.plan.stock_fsdp2_bytes / tide_bytes")
    plan = getattr(_C, "plan", None)
    need = ("Param", "plan_group", "stock_fsdp2_bytes", "tide_bytes", "rs_pipeline")
    if plan is None or not all(hasattr(plan, n) for n in need):
        pytest.skip("tide._C has no plan binding with " + ", ".join(need))
    return plan


PARAM_LISTS = [
    [(10, 3), (5,)],
    [(1024, 4096), (4096,), (4096, 1024)],
    [(509, 256), (683, 256), (256, 683), (256,)],
    [(128, 96, 32), (7,)],
]


@pytest.mark.parametrize("shapes", PARAM_LISTS)
@pytest.mark.parametrize("ws", [1, 2, 8, 64])
def test_bytes_match_planner(shapes, ws):
    plan = _planner()
    layout = plan.plan_group([plan.Param(list(s), 2, 0) for s in shapes], ws)
    got = plan.stock_fsdp2_bytes(layout, reduce_elem_size=4, orig_elem_size=4)
    mine = M.stock_bytes(shapes, ws, elem_size=2, reduce_elem_size=4, orig_elem_size=4)
    for k in ("param_storage", "ag_input", "ag_output", "rs_input", "rs_output"):
        assert getattr(got, k) == getattr(mine, k), k
    pipe = plan.rs_pipeline(layout, chunk_bytes=1 << 16, max_inflight=2, staging_elem_size=4)
    assert pipe.staging_bytes() == M.rs_staging_bytes(shapes, ws, 1 << 16, 2, 4)
    for rank in {0, ws - 1}:
        t = plan.tide_bytes(layout, rank, pipe.staging_bytes(), reduce_elem_size=4, orig_elem_size=4)
        mt = M.tide_bytes(shapes, ws, rank, pipe.staging_bytes(), elem_size=2, reduce_elem_size=4)
        assert t.collective() == mt.collective()
        assert t.param_storage == mt.param_storage and t.rs_output == mt.rs_output


@pytest.mark.parametrize("nodes,g", [(2, 8), (3, 8), (4, 4), (7, 2), (7, 1), (1, 8)])
def test_allgather_traffic_matches_the_planners_schedule(nodes, g):
    """The model's TIDE-AG traffic per rank (NIC bytes, NVLink bytes, RDMA steps) against
    the two-level schedule the executor runs, summed transfer by transfer. Shapes divide
    evenly by every world size here, so the model's even split is exact."""
    plan = _planner()
    if not hasattr(plan, "node_allgather_schedule"):
        pytest.skip("tide._C.plan has no node_allgather_schedule")
    ws = nodes * g
    params = [plan.Param([336 * 4, 96], 2, 0), plan.Param([336], 4, 0), plan.Param([48, 336 * 2], 2, 1)]
    layout = plan.plan_group(params, ws)
    S = sum(p.numel * p.elem_size for p in layout.params)
    sched = plan.node_allgather_schedule(layout, plan.Topology(ws, g), 1 << 16)
    want = M.tide_allgather_traffic(g, nodes, S)
    assert len(sched.inter_node.steps) == want["net_steps"]
    net, node = [0] * ws, [0] * ws
    for step in sched.inter_node.steps:
        for rnd in step.rounds:
            for t in rnd.transfers:
                net[t.dst_rank] += (t.shard_end - t.shard_begin) * layout.params[t.param].elem_size
    for c in sched.node_local:
        node[c.block.dst_rank] += (c.block.shard_end - c.block.shard_begin) * layout.params[c.block.param].elem_size
    assert net == [want["net_bytes"]] * ws
    assert node == [want["node_bytes"]] * ws


# ---- the CPU host transport: predicted vs measured -------------------------------------------

def test_host_model_by_hand():
    # 2 ranks, 8 MiB each, 10 GB/s: (2 + 1) x 8 MiB copied, 4 slot handshakes of 20 us.
    b = 8 << 20
    assert M.host_allgather_time(b, 2, 10.0) == pytest.approx(3 * b / 10e9 + 4 * 20e-6)
    assert M.host_reducescatter_time(b, 2, 10.0) == pytest.approx(
        (2 * b + 3 * b / 2) / 10e9 + 8 * 20e-6)
