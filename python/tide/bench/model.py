"""Step-time and memory model of FSDP2 training on a multi-node NVIDIA cluster.

Compares Stock FSDP2, FSDP2+SymmMem and TIDE from first principles (docs/model.md has the
equations and every assumption). Run:

    python -m tide.bench.model [--hw h200-measured] [--gpus 64] [--calibrate results.json]
                               [--out benchmarks/results]

(or `python python/tide/bench/model.py ...` without building tide._C). No constant here is
fitted to the TIDE paper's outcomes; the paper's figures are printed beside the model's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):  # run as a file: import the sibling modules directly
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hardware as hwmod  # type: ignore
    import workloads as wlmod  # type: ignore
else:
    from . import hardware as hwmod
    from . import workloads as wlmod

Hardware = hwmod.Hardware
GB = 1e9
GiB = float(2**30)
MiB = float(2**20)
IMPLS = ("stock", "symm", "tide")
LABELS = {"stock": "Stock FSDP2", "symm": "FSDP2+SymmMem", "tide": "TIDE"}

# The paper's figures (shared/mission/TIDE.md), printed beside the model's. Never used in a
# computation.
PAPER = {
    "step_vs_stock_pct": -27.1,  # "up to", 64 GPUs, best of the three workloads
    "step_vs_symm_pct": -6.0,  # "up to"
    "layout_share_pct": 6.4,  # Llama-3.1 70B, 8K tokens/GPU, stock
    "gemm_slowdown_pct": 69.0,  # single-wave GEMM with a concurrent default NCCL RS
    "rs_sm_time_ratio": (12.5, 14.5),
    "interference_ratio": 10.0,  # "up to an order of magnitude"
    "rs_buffer_16_to_64": "nearly constant",
    "peak_vs_symm_GiB": -4.7,  # "up to 4.7 GiB below"
}


@dataclass
class Options:
    world_size: int = 64
    reduce_elem_size: int = 4  # fp32 reduce (MixedPrecisionPolicy(reduce_dtype=float32))
    param_elem_size: int = 2  # bf16 params for compute
    master_elem_size: int = 4  # fp32 sharded params
    rs_chunk_bytes: int = 4 << 20  # TIDE-RS staging chunk (RsPipelineOptions default)
    rs_max_inflight: int = 2  # TIDE-RS slots (RsPipelineOptions default)
    slot_reuse: bool = False
    cross_node_elem_size: int = 4  # TIDE-RS cross-node partial sums in fp32
    accumulate_GBps: float | None = None  # TIDE accumulate kernel rate; None: hbm_copy_GBps
    optimizer_bytes_per_param: int = 28  # Adam: read p, g, m, v (16 B), write p, m, v (12 B)


# ---------------------------------------------------------------------------------------
# Byte accounting (the formulas of tide._C.plan: sharding.cpp and accounting.cpp)
# ---------------------------------------------------------------------------------------

@dataclass
class ParamShard:
    numel: int
    padded_shard_numel: int  # every rank's all-gather input
    shard_numels: list  # real elements per rank


def shard_param(shape, world_size: int) -> ParamShard:
    """FSDP2's Shard(0): torch.chunk along dim 0, every shard padded to chunk rows."""
    if len(shape) == 0:
        raise ValueError("0-dim parameter")
    rows = shape[0]
    inner = 1
    for d in shape[1:]:
        inner *= d
    chunk = -(-rows // world_size)  # ceil
    shards = []
    for r in range(world_size):
        begin = min(rows, r * chunk)
        end = min(rows, begin + chunk)
        shards.append((end - begin) * inner)
    return ParamShard(rows * inner, chunk * inner, shards)


@dataclass
class BufferBytes:
    param_storage: int = 0
    ag_input: int = 0
    ag_output: int = 0
    rs_input: int = 0
    rs_output: int = 0
    staging: int = 0

    def collective(self) -> int:
        return self.ag_input + self.ag_output + self.rs_input + self.rs_output + self.staging


def stock_bytes(shapes, world_size: int, elem_size: int = 2, reduce_elem_size: int = 4,
                orig_elem_size: int = 0) -> BufferBytes:
    """Per rank, per unit: stock FSDP2 (foreach_all_gather + foreach_reduce)."""
    ps = [shard_param(s, world_size) for s in shapes]
    padded = sum(p.padded_shard_numel for p in ps)
    b = BufferBytes()
    b.param_storage = world_size * padded * elem_size
    casts = orig_elem_size != 0 and orig_elem_size != elem_size
    b.ag_input = padded * elem_size if casts else 0
    b.ag_output = world_size * padded * elem_size
    b.rs_input = world_size * padded * reduce_elem_size
    b.rs_output = padded * reduce_elem_size
    return b


def rs_staging_bytes(shapes, world_size: int, chunk_bytes: int = 4 << 20, max_inflight: int = 2,
                     staging_elem_size: int = 4) -> int:
    """TIDE-RS staging per rank (RsPipeline::staging_bytes): slots of one chunk each."""
    padded = sum(shard_param(s, world_size).padded_shard_numel for s in shapes)
    if padded == 0:
        return 0
    chunk_elems = max(1, chunk_bytes // staging_elem_size)
    slot_elems = min(chunk_elems, padded)
    nchunks = -(-padded // chunk_elems)
    return slot_elems * staging_elem_size * min(max_inflight, nchunks)


def tide_bytes(shapes, world_size: int, rank: int, staging: int, elem_size: int = 2,
               reduce_elem_size: int = 4) -> BufferBytes:
    ps = [shard_param(s, world_size) for s in shapes]
    b = BufferBytes()
    b.param_storage = world_size * sum(p.padded_shard_numel for p in ps) * elem_size
    b.rs_output = sum(p.shard_numels[rank] for p in ps) * reduce_elem_size
    b.staging = staging
    return b


# ---------------------------------------------------------------------------------------
# Collectives (seconds). S: bytes every rank ends up with (AG) or starts with (RS).
# ---------------------------------------------------------------------------------------

def _topology(hw: Hardware, ws: int) -> tuple[int, int]:
    g = min(hw.gpus_per_node, ws)
    return g, -(-ws // g)


def _net_time(hw: Hardware, ws: int, node_bytes_per_gpu: float) -> float:
    """Time for each GPU to move node_bytes_per_gpu through the network, one direction.

    NICs are shared evenly by the node's GPUs (rail-optimized: nics_per_node >= GPUs per
    node gives each GPU its own NIC)."""
    g, nodes = _topology(hw, ws)
    if nodes <= 1 or node_bytes_per_gpu <= 0:
        return 0.0
    per_gpu = hw.rdma_GBps * min(1.0, hw.nics_per_node / g)
    return node_bytes_per_gpu / (per_gpu * GB)


def ring_collective(hw: Hardware, ws: int, S: float, nvlink_GBps: float | None = None) -> dict:
    """NCCL ring all-gather / reduce-scatter (NCCL uses ring for both; tree only for
    all-reduce). Every GPU receives (and sends) S (ws-1)/ws bytes; at most S (nodes-1)/nodes
    / g of them cross each GPU's NIC."""
    if ws <= 1:
        return {"time": 0.0, "nvl": 0.0, "net": 0.0, "lat": 0.0}
    g, nodes = _topology(hw, ws)
    bw = (nvlink_GBps or hw.nvlink_nccl_GBps) * GB
    t_nvl = S * (ws - 1) / ws / bw
    t_net = _net_time(hw, ws, S * (nodes - 1) / nodes / g)
    lat = ((ws - nodes) * hw.nvlink_latency_us + (nodes - 1 if nodes > 1 else 0) * hw.rdma_latency_us) * 1e-6
    if nodes > 1:
        lat = ((ws - 1) * hw.nvlink_latency_us + nodes * hw.rdma_latency_us) * 1e-6
    return {"time": max(t_nvl, t_net) + lat, "nvl": t_nvl, "net": t_net, "lat": lat}


def tide_allgather_traffic(g: int, nodes: int, S: float) -> dict:
    """What each rank receives in TIDE-AG, as the planner's two-level schedule moves it
    (plan::node_allgather_schedule, executed by node_param_all_gather; tests/python/
    test_model.py checks these against the schedule): the paced recursive doubling over the
    nodes on its rail, ceil(log2(nodes)) steps bringing S (nodes-1)/nodes/g bytes through
    its NIC, and the other g-1 rails' blocks, S (g-1)/g bytes, from its node's peers. The
    pacing cuts a step into rounds of at most TIDE_ALLGATHER_PACE_BYTES per rank; the model
    counts one RDMA latency per step (rounds pipeline) and no pacing limit on bandwidth."""
    return {"net_bytes": S * (nodes - 1) / nodes / g, "node_bytes": S * (g - 1) / g,
            "net_steps": math.ceil(math.log2(nodes)) if nodes > 1 else 0}


def tide_allgather(hw: Hardware, ws: int, S: float) -> dict:
    """TIDE-AG: paced recursive doubling over the rails (RDMA, no SMs) pipelined with
    NVSwitch multicast inside the node (tide_allgather_traffic)."""
    if ws <= 1:
        return {"time": 0.0, "nvl": 0.0, "net": 0.0, "lat": 0.0}
    g, nodes = _topology(hw, ws)
    traffic = tide_allgather_traffic(g, nodes, S)
    t_nvl = traffic["node_bytes"] / (hw.nvlink_ce_GBps * GB)
    t_net = _net_time(hw, ws, traffic["net_bytes"])
    lat = traffic["net_steps"] * hw.rdma_latency_us * 1e-6
    lat += hw.nvlink_latency_us * 1e-6
    return {"time": max(t_nvl, t_net) + lat, "nvl": t_nvl, "net": t_net, "lat": lat}


def tide_partial_elem(g: int, grad_elem: int, cross_elem: int) -> int:
    """Bytes per element of a TIDE-RS node partial: cross_elem (fp32), but with one GPU per
    node the partial is that GPU's gradient, which crosses nodes in its own dtype (exact)."""
    return min(grad_elem, cross_elem) if g == 1 else cross_elem


def tide_accumulate_bytes(numel: int, ws: int, g: int, nodes: int, grad_elem: int = 2,
                          cross_elem: int = 4, out_elem: int = 4) -> float:
    """HBM bytes TIDE-RS's accumulation CTAs read + write per rank and unit.

    Node-local: read g staged slices of numel/g bf16 (= numel bf16 in all), write the fp32
    node partial (numel/g; at one GPU per node a copy of the gradient, counted alike).
    Cross-node: read `nodes` partials of numel/ws, write the shard. premul_sum keeps fp32
    partials at one GPU per node too; the model counts FSDP2's default (sum / avg)."""
    cross_elem = tide_partial_elem(g, grad_elem, cross_elem)
    node_local = numel * grad_elem + numel / g * cross_elem
    cross = (nodes * numel / ws * cross_elem + numel / ws * out_elem) if nodes > 1 else 0.0
    return node_local + cross


def tide_reducescatter_traffic(g: int, nodes: int, numel: float, grad_elem: int = 2,
                                cross_elem: int = 4) -> dict:
    """What each rank moves in TIDE-RS across nodes, as node_param_reduce_scatter
    (src/collectives/param_reduce_scatter.cpp) moves it: from its node's g-1 peers, their
    slices of the elements of its rail (numel/g of them, grad dtype); through its NIC, the
    node partials of the other nodes' rail ranks (numel/g (nodes-1)/nodes elements, fp32;
    grad dtype at one GPU per node: tide_partial_elem), all of a window's in one exchange,
    windows pipelined (one RDMA latency counted).
    tests/python/test_pseudo_nodes.py checks net_bytes against the bytes its engine sent."""
    cross_elem = tide_partial_elem(g, grad_elem, cross_elem)
    return {"net_bytes": numel / g * cross_elem * (nodes - 1) / nodes,
            "node_bytes": numel / g * grad_elem * (g - 1),
            "net_steps": 1 if nodes > 1 else 0}


def tide_reducescatter(hw: Hardware, ws: int, numel: int, opt: Options) -> dict:
    """TIDE-RS two-phase: copy engines bring the other g-1 GPUs' bf16 slices of this GPU's
    node slice (NVLink), short CTAs accumulate them in fp32, RDMA sends the node partials
    along the rail (cross_node_elem_size bytes per element; tide_reducescatter_traffic).
    The pipeline overlaps the three; the slowest sets the time."""
    if ws <= 1:
        return {"time": 0.0, "nvl": 0.0, "net": 0.0, "lat": 0.0, "acc": 0.0, "acc_bytes": 0.0}
    g, nodes = _topology(hw, ws)
    traffic = tide_reducescatter_traffic(g, nodes, numel, opt.param_elem_size, opt.cross_node_elem_size)
    t_nvl = traffic["node_bytes"] / (hw.nvlink_ce_GBps * GB)
    t_net = _net_time(hw, ws, traffic["net_bytes"])
    acc_bytes = tide_accumulate_bytes(numel, ws, g, nodes, opt.param_elem_size,
                                      opt.cross_node_elem_size, opt.reduce_elem_size)
    t_acc = acc_bytes / ((opt.accumulate_GBps or hw.hbm_copy_GBps) * GB)
    lat = traffic["net_steps"] * hw.rdma_latency_us * 1e-6
    lat += 2 * hw.nvlink_latency_us * 1e-6
    return {"time": max(t_nvl, t_net, t_acc) + lat, "nvl": t_nvl, "net": t_net, "lat": lat,
            "acc": t_acc, "acc_bytes": acc_bytes}


# ---------------------------------------------------------------------------------------
# Compute and SM interference
# ---------------------------------------------------------------------------------------

def gemm_wave_slowdown(tiles: int, sms: int, held: int) -> float:
    """A GEMM of `tiles` output tiles on `sms` SMs, `held` of them taken by another kernel:
    waves go from ceil(tiles/sms) to ceil(tiles/(sms-held))."""
    if held <= 0 or tiles <= 0:
        return 1.0
    free = sms - held
    if free <= 0:
        return math.inf
    return math.ceil(tiles / free) / math.ceil(tiles / sms)


def gemm_tiles(g: wlmod.Gemm, hw: Hardware) -> int:
    bm, bn = hw.gemm_tile
    return math.ceil(g.m / bm) * math.ceil(g.n / bn)


def unit_slowdown(unit: wlmod.Unit, hw: Hardware, held: int, backward: bool = False) -> float:
    """FLOP-weighted slowdown of a unit's compute while `held` SMs are taken. Backward GEMMs
    (dX = dY W^T: m x k tiles; dW = X^T dY: n x k tiles) are weighted likewise."""
    if held <= 0:
        return 1.0
    num = den = 0.0
    for g in unit.gemms:
        # forward: output m x n; backward: dX (m x k) and dW (n x k), same FLOPs each
        outs = [(g.m, g.n)] if not backward else [(g.m, g.k), (g.n, g.k)]
        for m, n in outs:
            tiles = gemm_tiles(wlmod.Gemm(m, n, 1), hw) * (g.count if g.grouped else 1)
            s = gemm_wave_slowdown(tiles, hw.sm_count, held)
            num += g.flops * s
            den += g.flops
    if unit.attn_flops:
        s = hw.sm_count / (hw.sm_count - held)  # many-wave flash attention: SM share
        num += unit.attn_flops * s
        den += unit.attn_flops
    return num / den if den else 1.0


def compute_times(unit: wlmod.Unit, hw: Hardware) -> tuple[float, float]:
    """Forward and backward seconds at full speed (backward = 2x GEMM FLOPs, 2.5x attention)."""
    gr, ar = hw.gemm_bf16_TFLOPs * 1e12, hw.attn_TFLOPs * 1e12
    f = unit.gemm_flops / gr + unit.attn_flops / ar
    b = 2.0 * unit.gemm_flops / gr + 2.5 * unit.attn_flops / ar
    return f, b


def overlapped(compute: float, slowdown: float, held_time: float) -> float:
    """Compute time when another kernel holds SMs for held_time from the start of it:
    progress at 1/slowdown while held, full speed after."""
    if slowdown <= 1.0 or held_time <= 0.0:
        return compute
    if compute * slowdown <= held_time:
        return compute * slowdown
    return held_time + (compute - held_time / slowdown)


# ---------------------------------------------------------------------------------------
# Per-unit costs and the FSDP2 schedule
# ---------------------------------------------------------------------------------------

@dataclass
class UnitCost:
    name: str
    numel: int
    fwd: float
    bwd: float
    ag: float = 0.0
    rs: float = 0.0
    ag_ctas: int = 0
    rs_ctas: int = 0
    copy_ag: float = 0.0  # compute-stream layout copy per all-gather (copy-out)
    copy_ag_side: float = 0.0  # copy-in on the all-gather stream (still GPU time)
    copy_rs: float = 0.0  # chunk_cat before each reduce-scatter
    acc: float = 0.0  # TIDE accumulation CTAs per reduce-scatter (GPU time)
    acc_bytes: float = 0.0
    bytes: dict = field(default_factory=dict)


def unit_cost(impl: str, unit: wlmod.Unit, hw: Hardware, opt: Options) -> UnitCost:
    ws = opt.world_size
    f, b = compute_times(unit, hw)
    shapes = unit.params
    c = UnitCost(unit.name, unit.numel, f, b)
    if not shapes:
        return c
    sb = stock_bytes(shapes, ws, opt.param_elem_size, opt.reduce_elem_size, opt.master_elem_size)
    padded = sb.ag_output // opt.param_elem_size // ws  # padded shard numel
    U = sb.ag_output  # unsharded bytes incl. padding (bf16)
    hbm = hw.hbm_copy_GBps * GB
    c.bytes = {"stock": asdict(sb)}
    if impl in ("stock", "symm"):
        # copy-in: the bf16 shards into the flat buffer's own slice (read + write);
        # copy-out: split_with_sizes_copy of the whole gathered buffer (read + write);
        # chunk_cat: read bf16 gradients, write the fp32 rank-major buffer.
        c.copy_ag_side = 2.0 * padded * opt.param_elem_size / hbm
        c.copy_ag = 2.0 * U / hbm
        c.copy_rs = (unit.numel * opt.param_elem_size + sb.rs_input) / hbm
        if impl == "stock":
            c.ag = ring_collective(hw, ws, U)["time"]
            c.ag_ctas = hw.nccl_ctas
        else:  # symmetric memory: NCCL copy-engine all-gather, no SMs
            c.ag = ring_collective(hw, ws, U, hw.nvlink_ce_GBps)["time"]
            c.ag_ctas = 0
        c.rs = ring_collective(hw, ws, sb.rs_input)["time"]
        c.rs_ctas = hw.nccl_ctas
    else:
        c.ag = tide_allgather(hw, ws, U)["time"]
        rs = tide_reducescatter(hw, ws, unit.numel, opt)
        c.rs, c.acc, c.acc_bytes = rs["time"], rs["acc"], rs["acc_bytes"]
        staging = 0 if opt.slot_reuse else rs_staging_bytes(shapes, ws, opt.rs_chunk_bytes,
                                                             opt.rs_max_inflight, opt.reduce_elem_size)
        c.bytes["tide"] = asdict(tide_bytes(shapes, ws, 0, staging, opt.param_elem_size,
                                            opt.reduce_elem_size))
    return c


def simulate(impl: str, wl: wlmod.Workload, hw: Hardware, opt: Options) -> dict:
    """One training step under FSDP2's schedule (implicit prefetch, reshard after forward).

    Forward, block i: [copy-out of i] + max(F_i slowed while AG_{i+1} holds SMs,
                                           copy-in + AG_{i+1}).
    Backward, block i (reverse): [copy-out of i, chunk_cat/accumulate of i+1]
        + max(recompute + B_i slowed while AG_{i-1} / RS_{i+1} hold SMs, AG_{i-1} + RS_{i+1}).
    Exposed: the first all-gathers, the last reduce-scatters, the optimizer step."""
    costs = [unit_cost(impl, u, hw, opt) for u in wl.units]
    root, blocks = costs[0], costs[1:]
    comp = {"compute": 0.0, "interference": 0.0, "layout_copies": 0.0, "rs_ctas": 0.0,
            "exposed_comm": 0.0, "optimizer": 0.0}
    sm_time = {"rs": 0.0, "ag": 0.0}

    def stage(compute_side_pure, held_ctas, held_time, unit, backward, extra_gpu, comm_side):
        s = unit_slowdown(unit, hw, held_ctas, backward) if held_ctas else 1.0
        eff = overlapped(compute_side_pure, s, held_time)
        comp["compute"] += compute_side_pure
        comp["interference"] += eff - compute_side_pure
        gpu = eff + sum(extra_gpu.values())
        for k, v in extra_gpu.items():
            comp[k] += v
        t = max(gpu, comm_side)
        comp["exposed_comm"] += t - gpu
        return t

    nb = len(blocks)
    recompute = wl.activation_checkpointing
    total = 0.0
    # Forward: root and block 0 all-gathers have nothing to hide behind.
    total += stage(0.0, 0, 0.0, wl.units[0], False, {"layout_copies": root.copy_ag},
                   root.copy_ag_side + root.ag + blocks[0].copy_ag_side + blocks[0].ag)
    sm_time["ag"] += root.ag * root.ag_ctas + blocks[0].ag * blocks[0].ag_ctas
    for i, c in enumerate(blocks):
        nxt = blocks[i + 1] if i + 1 < nb else None
        ag_next = (nxt.copy_ag_side + nxt.ag) if nxt else 0.0
        ctas = nxt.ag_ctas if nxt else 0
        held = nxt.ag if nxt else 0.0
        sm_time["ag"] += held * ctas
        total += stage(c.fwd, ctas, held, wl.units[i + 1], False,
                       {"layout_copies": c.copy_ag}, ag_next)
    # Output head forward + backward (root unit stays unsharded), prefetching the last
    # block's all-gather for backward.
    last = blocks[-1]
    sm_time["ag"] += last.ag * last.ag_ctas
    total += stage(root.fwd + root.bwd, last.ag_ctas, last.ag, wl.units[0], True, {},
                   last.copy_ag_side + last.ag)
    # Backward, blocks in reverse.
    for i in range(nb - 1, -1, -1):
        c = blocks[i]
        prev = blocks[i - 1] if i > 0 else None
        done = blocks[i + 1] if i + 1 < nb else None  # its gradients are being reduced
        ag = (prev.copy_ag_side + prev.ag) if prev else 0.0
        rs = done.rs if done else 0.0
        extra = {"layout_copies": c.copy_ag + (done.copy_rs if done else 0.0),
                 "rs_ctas": done.acc if done else 0.0}
        # SM holders: the all-gather kernel, then the reduce-scatter kernel (one network).
        ag_ctas = prev.ag_ctas if prev else 0
        rs_ctas = done.rs_ctas if done else 0
        work = (c.fwd if recompute else 0.0) + c.bwd
        sm_time["ag"] += (prev.ag if prev else 0.0) * ag_ctas
        sm_time["rs"] += rs * rs_ctas + (done.acc * hw.sm_count if done else 0.0)
        held_ctas = max(ag_ctas, rs_ctas)
        held_time = (ag if ag_ctas else 0.0) + (rs if rs_ctas else 0.0)
        total += stage(work, held_ctas, held_time, wl.units[i + 1], True, extra, ag + rs)
    # Tail: the first block's and the root's reduce-scatters, then the optimizer.
    first = blocks[0]
    tail_gpu = {"layout_copies": first.copy_rs + root.copy_rs, "rs_ctas": first.acc + root.acc}
    sm_time["rs"] += first.rs * first.rs_ctas + root.rs * root.rs_ctas
    sm_time["rs"] += (first.acc + root.acc) * hw.sm_count
    total += stage(0.0, 0, 0.0, wl.units[0], True, tail_gpu, first.rs + root.rs)
    shard_params = wl.numel / opt.world_size
    opt_t = shard_params * opt.optimizer_bytes_per_param / (hw.hbm_copy_GBps * GB)
    comp["optimizer"] += opt_t
    total += opt_t
    return {"impl": impl, "step_s": total, "breakdown": comp, "sm_time_s": sm_time,
            "units": costs}


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------

def peak_memory(impl: str, wl: wlmod.Workload, hw: Hardware, opt: Options) -> dict:
    """Per-rank peak bytes at the backward of the largest block.

    static: fp32 sharded params, fp32 sharded grads, Adam m and v (16 B per sharded param).
    activations: per-block checkpoints (block inputs) + one block's full activations
      (recompute) + the root's fp32 logits.
    in flight: unsharded bf16 storages of two blocks (current + prefetched), the current
      block's unsharded bf16 gradients, and the collective buffers:
      stock: all-gather input + flat output (prefetched block) + fp32 reduce-scatter input;
      symm: the same plus one more all-gather output and reduce-scatter input, because the
            symmetric pool keeps its blocks (double-buffered, never returned to the caching
            allocator for other tensors) - an assumption, see docs/model.md;
      tide: reduce-scatter staging (slots x chunk), 0 with Slot-Reuse."""
    ws = opt.world_size
    static = 16.0 * wl.numel / ws
    blocks = wl.blocks
    if wl.activation_checkpointing:
        acts = sum(u.ckpt_bytes for u in blocks) + max(u.act_bytes for u in blocks)
    else:
        acts = sum(u.act_bytes for u in blocks)
    acts += wl.root.act_bytes
    big = max(blocks, key=lambda u: u.numel)
    sb = stock_bytes(big.params, ws, opt.param_elem_size, opt.reduce_elem_size, opt.master_elem_size)
    storages = 2 * sb.param_storage
    grads = big.numel * opt.param_elem_size
    root_storage = stock_bytes(wl.root.params, ws, opt.param_elem_size).param_storage if wl.root.params else 0
    if impl == "stock":
        coll = sb.ag_input + sb.ag_output + sb.rs_input
    elif impl == "symm":
        coll = sb.ag_input + 2 * sb.ag_output + 2 * sb.rs_input
    else:
        coll = 0 if opt.slot_reuse else rs_staging_bytes(big.params, ws, opt.rs_chunk_bytes,
                                                         opt.rs_max_inflight, opt.reduce_elem_size)
    total = static + acts + storages + grads + root_storage + coll
    return {"impl": impl, "peak_bytes": total, "static": static, "activations": acts,
            "unsharded": storages + grads + root_storage, "collective_buffers": coll,
            "fits": total <= hw.hbm_GiB * GiB}


def rs_buffer_bytes(impl: str, per_gpu_output_bytes: int, ws: int, opt: Options) -> int:
    """Reduce-scatter buffer per rank at a fixed per-GPU fp32 output size."""
    n = per_gpu_output_bytes // opt.reduce_elem_size  # elements of the output shard
    shapes = [(n * ws,)]
    if impl in ("stock", "symm"):
        sb = stock_bytes(shapes, ws, opt.param_elem_size, opt.reduce_elem_size)
        return sb.rs_input * (2 if impl == "symm" else 1)
    return 0 if opt.slot_reuse else rs_staging_bytes(shapes, ws, opt.rs_chunk_bytes,
                                                      opt.rs_max_inflight, opt.reduce_elem_size)


# ---------------------------------------------------------------------------------------
# The CPU host transport (tests: predicted vs measured on this machine)
# ---------------------------------------------------------------------------------------

def host_allgather_time(bytes_per_rank: float, ws: int, memcpy_GBps: float,
                        threads_per_rank: int = 1, sync_us: float = 20.0,
                        slot_bytes: float = 2 * MiB) -> float:
    """Host (shared-memory) all-gather: each rank copies its input once into its staging
    and every chunk (peers' and its own) out: (ws + 1) x bytes copied per rank, by
    `threads_per_rank` cores at memcpy_GBps each (bytes copied per second), plus one
    flag handshake per staging slot."""
    copies = (ws + 1) * bytes_per_rank
    slots = math.ceil(bytes_per_rank / slot_bytes)
    return copies / (memcpy_GBps * GB * threads_per_rank) + slots * sync_us * 1e-6


def host_reducescatter_time(out_bytes_per_rank: float, ws: int, memcpy_GBps: float,
                            threads_per_rank: int = 1, sync_us: float = 20.0,
                            slot_bytes: float = 2 * MiB) -> float:
    """Host reduce-scatter: each rank copies its ws x out input into staging, then reduces
    ws staged sources into its output (reads ws x out, writes out: a memcpy moves one byte
    read + one written, so this traffic counts half)."""
    stage = ws * out_bytes_per_rank
    reduce = (ws + 1) * out_bytes_per_rank / 2.0
    slots = math.ceil(stage / slot_bytes)
    return (stage + reduce) / (memcpy_GBps * GB * threads_per_rank) + slots * sync_us * 1e-6


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def run_workload(wl: wlmod.Workload, hw: Hardware, opt: Options) -> dict:
    sims = {impl: simulate(impl, wl, hw, opt) for impl in IMPLS}
    mems = {impl: peak_memory(impl, wl, hw, opt) for impl in IMPLS}
    opt_sr = Options(**{**asdict(opt), "slot_reuse": True})
    mem_sr = peak_memory("tide", wl, hw, opt_sr)
    st = {k: v["step_s"] for k, v in sims.items()}
    big = max(wl.blocks, key=lambda u: u.numel)
    held = hw.nccl_ctas
    out = {
        "workload": wl.name, "notes": wl.notes, "params_B": wl.numel / 1e9,
        "step_s": st,
        "tide_vs_stock_pct": 100.0 * (st["tide"] / st["stock"] - 1.0),
        "tide_vs_symm_pct": 100.0 * (st["tide"] / st["symm"] - 1.0),
        "symm_vs_stock_pct": 100.0 * (st["symm"] / st["stock"] - 1.0),
        "breakdown_s": {k: v["breakdown"] for k, v in sims.items()},
        "layout_share_pct": {k: 100.0 * v["breakdown"]["layout_copies"] / v["step_s"]
                             for k, v in sims.items()},
        "rs_sm_time_s": {k: v["sm_time_s"]["rs"] for k, v in sims.items()},
        "interference_s": {k: v["breakdown"]["interference"] + v["breakdown"]["rs_ctas"]
                           for k, v in sims.items()},
        "block_gemm_slowdown_pct": 100.0 * (unit_slowdown(big, hw, held, True) - 1.0),
        "peak_GiB": {k: v["peak_bytes"] / GiB for k, v in mems.items()},
        "peak_GiB_tide_slot_reuse": mem_sr["peak_bytes"] / GiB,
        "memory": {k: {kk: (vv / GiB if isinstance(vv, float) or isinstance(vv, int) else vv)
                       for kk, vv in v.items() if kk != "impl"} for k, v in mems.items()},
        "per_block": {k: {"ag_ms": 1e3 * v["units"][1].ag, "rs_ms": 1e3 * v["units"][1].rs,
                          "fwd_ms": 1e3 * v["units"][1].fwd, "bwd_ms": 1e3 * v["units"][1].bwd,
                          "copy_ag_ms": 1e3 * v["units"][1].copy_ag,
                          "copy_rs_ms": 1e3 * v["units"][1].copy_rs,
                          "acc_ms": 1e3 * v["units"][1].acc} for k, v in sims.items()},
    }
    r = out["rs_sm_time_s"]
    out["rs_sm_time_ratio"] = r["stock"] / r["tide"] if r["tide"] else math.inf
    i = out["interference_s"]
    out["interference_ratio"] = i["stock"] / i["tide"] if i["tide"] else math.inf
    return out


def single_wave_slowdown_pct(hw: Hardware) -> float:
    """A GEMM of exactly one full wave (tiles = SMs) while a default NCCL kernel holds
    nccl_ctas SMs."""
    return 100.0 * (gemm_wave_slowdown(hw.sm_count, hw.sm_count, hw.nccl_ctas) - 1.0)


def run_all(hw: Hardware, opt: Options, workloads=None) -> dict:
    names = workloads or list(wlmod.WORKLOADS)
    res = {"hardware": asdict(hw), "options": asdict(opt), "paper": PAPER, "workloads": {}}
    for name in names:
        res["workloads"][name] = run_workload(wlmod.WORKLOADS[name](), hw, opt)
    res["single_wave_gemm_slowdown_pct"] = single_wave_slowdown_pct(hw)
    out_bytes = 256 << 20  # fixed per-GPU fp32 output: 256 MiB
    sizes = [8, 16, 32, 64, 128, 256]
    res["rs_buffer"] = {"per_gpu_output_MiB": out_bytes / MiB, "world_sizes": sizes,
                        **{impl: [rs_buffer_bytes(impl, out_bytes, w, opt) / MiB for w in sizes]
                           for impl in IMPLS}}
    return res


def _fmt_pct(x: float) -> str:
    return f"{x:+.1f}%"


def format_table(res: dict) -> str:
    hw, opt = res["hardware"], res["options"]
    W = res["workloads"]
    lines = []
    lines.append(f"TIDE step-time/memory model: {opt['world_size']} GPUs "
                 f"({hw['gpus_per_node']}/node), hardware '{hw['name']}'")
    lines.append(f"  {hw['source']}")
    if hw.get("measured"):
        lines.append(f"  calibrated from measurements: {hw['measured']}")
    lines.append("")
    hdr = f"{'workload':<15}{'Stock s':>9}{'Symm s':>9}{'TIDE s':>9}{'TIDE/Stock':>12}{'TIDE/Symm':>11}" \
          f"{'layout%':>9}{'peak GiB S/Sy/T/T+SR':>26}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for name, w in W.items():
        s, p = w["step_s"], w["peak_GiB"]
        lines.append(f"{name:<15}{s['stock']:>9.3f}{s['symm']:>9.3f}{s['tide']:>9.3f}"
                     f"{_fmt_pct(w['tide_vs_stock_pct']):>12}{_fmt_pct(w['tide_vs_symm_pct']):>11}"
                     f"{w['layout_share_pct']['stock']:>8.1f}%"
                     f"{p['stock']:>8.1f}/{p['symm']:.1f}/{p['tide']:.1f}/{w['peak_GiB_tide_slot_reuse']:.1f}")
    lines.append("")
    lines.append("Per-step breakdown (s): compute | SM interference | layout copies | TIDE RS CTAs | "
                 "exposed comm | optimizer")
    for name, w in W.items():
        for impl in IMPLS:
            b = w["breakdown_s"][impl]
            lines.append(f"  {name:<14}{LABELS[impl]:<15}{b['compute']:>8.3f}{b['interference']:>8.3f}"
                         f"{b['layout_copies']:>8.3f}{b['rs_ctas']:>8.3f}{b['exposed_comm']:>8.3f}"
                         f"{b['optimizer']:>8.3f}")
    lines.append("")
    lines.append("Per block (ms): fwd / bwd compute, AG, RS, copy-out per AG, chunk_cat per RS, TIDE acc")
    for name, w in W.items():
        for impl in IMPLS:
            b = w["per_block"][impl]
            lines.append(f"  {name:<14}{LABELS[impl]:<15}{b['fwd_ms']:>7.2f}{b['bwd_ms']:>7.2f}"
                         f"{b['ag_ms']:>7.2f}{b['rs_ms']:>7.2f}{b['copy_ag_ms']:>7.2f}"
                         f"{b['copy_rs_ms']:>7.2f}{b['acc_ms']:>7.2f}")
    lines.append("")
    # Headline figures beside the paper's.
    best_stock = min(W.values(), key=lambda w: w["tide_vs_stock_pct"])
    best_symm = min(W.values(), key=lambda w: w["tide_vs_symm_pct"])
    llama = W.get("llama3.1-70b")
    ratios = [w["rs_sm_time_ratio"] for w in W.values()]
    interf = max(W.values(), key=lambda w: w["interference_ratio"])
    peak_delta = min(W.values(), key=lambda w: w["peak_GiB"]["tide"] - w["peak_GiB"]["symm"])
    rb = res["rs_buffer"]
    i16, i64 = rb["world_sizes"].index(16), rb["world_sizes"].index(64)
    rows = [
        ("step time vs Stock FSDP2 (best)", _fmt_pct(PAPER["step_vs_stock_pct"]),
         f"{_fmt_pct(best_stock['tide_vs_stock_pct'])} ({best_stock['workload']})"),
        ("step time vs FSDP2+SymmMem (best)", _fmt_pct(PAPER["step_vs_symm_pct"]),
         f"{_fmt_pct(best_symm['tide_vs_symm_pct'])} ({best_symm['workload']})"),
        ("layout conversion share, Llama 70B 8K", f"{PAPER['layout_share_pct']:.1f}%",
         f"{llama['layout_share_pct']['stock']:.1f}%" if llama else "n/a"),
        ("GEMM slowdown, concurrent NCCL RS", f"+{PAPER['gemm_slowdown_pct']:.0f}%",
         f"{res['single_wave_gemm_slowdown_pct']:+.0f}% one-wave GEMM, "
         f"{llama['block_gemm_slowdown_pct']:+.1f}% Llama block" if llama else
         f"{res['single_wave_gemm_slowdown_pct']:+.0f}%"),
        ("RS SM time, Stock / TIDE", "12.5-14.5x",
         "-".join(f"{x:.1f}" for x in (min(ratios), max(ratios))) + "x"),
        ("interference, Stock / TIDE (best)", f"up to {PAPER['interference_ratio']:.0f}x",
         f"{interf['interference_ratio']:.1f}x ({interf['workload']})"),
        ("RS buffer 16 -> 64 GPUs (fixed output)", "nearly constant",
         f"Stock {rb['stock'][i16]:.0f} -> {rb['stock'][i64]:.0f} MiB, "
         f"TIDE {rb['tide'][i16]:.0f} -> {rb['tide'][i64]:.0f} MiB"),
        ("peak memory, TIDE - SymmMem (best)", f"{PAPER['peak_vs_symm_GiB']:.1f} GiB",
         f"{peak_delta['peak_GiB']['tide'] - peak_delta['peak_GiB']['symm']:+.1f} GiB "
         f"({peak_delta['workload']})"),
        ("peak memory, TIDE+Slot-Reuse - Stock, Wan2.2", "below Stock",
         f"{W['wan2.2-14b']['peak_GiB_tide_slot_reuse'] - W['wan2.2-14b']['peak_GiB']['stock']:+.2f} GiB"
         if "wan2.2-14b" in W else "n/a"),
    ]
    lines.append(f"{'figure':<46}{'paper':>16}   model")
    lines.append("-" * 100)
    for name, paper, model in rows:
        lines.append(f"{name:<46}{paper:>16}   {model}")
    return "\n".join(lines)


def write_plots(res: dict, out_dir: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    W = res["workloads"]
    keys = ["compute", "interference", "layout_copies", "rs_ctas", "exposed_comm", "optimizer"]
    colors = ["#4c72b0", "#dd8452", "#c44e52", "#8172b3", "#937860", "#55a868"]
    fig, axes = plt.subplots(1, len(W), figsize=(4.2 * len(W), 4.2), squeeze=False)
    for ax, (name, w) in zip(axes[0], W.items()):
        bottom = [0.0] * len(IMPLS)
        for k, col in zip(keys, colors):
            vals = [w["breakdown_s"][impl][k] for impl in IMPLS]
            ax.bar([LABELS[i] for i in IMPLS], vals, bottom=bottom, color=col, label=k)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(name)
        ax.set_ylabel("seconds per step (model)")
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Step-time breakdown, {res['options']['world_size']} GPUs, {res['hardware']['name']}")
    fig.tight_layout()
    p = os.path.join(out_dir, "model_step_breakdown.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    rb = res["rs_buffer"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for impl in IMPLS:
        ax.plot(rb["world_sizes"], rb[impl], marker="o", label=LABELS[impl])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("reduce-scatter buffer per rank (MiB)")
    ax.set_title(f"RS buffer at {rb['per_gpu_output_MiB']:.0f} MiB fp32 output per GPU")
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "model_rs_buffer.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "__dataclass_fields__"):
        return _jsonable(asdict(x))
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tide.bench.model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hw", default=hwmod.DEFAULT, choices=sorted(hwmod.PRESETS))
    ap.add_argument("--gpus", type=int, default=64, help="world size (default 64)")
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--workload", action="append", choices=sorted(wlmod.WORKLOADS),
                    help="repeatable; default: all three")
    ap.add_argument("--calibrate", metavar="results.json",
                    help="replace preset constants by measured ones (docs/model.md)")
    ap.add_argument("--slot-reuse", action="store_true", help="TIDE with Slot-Reuse")
    ap.add_argument("--out", metavar="DIR", help="write model.json, model.txt and PNGs here")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a = ap.parse_args(argv)
    hw = hwmod.PRESETS[a.hw]
    extras = {}
    if a.calibrate:
        hw, extras = hwmod.load_calibration(a.calibrate, hw)
    if a.gpus_per_node:
        hw = hw.replace(gpus_per_node=a.gpus_per_node, nics_per_node=a.gpus_per_node)
    opt = Options(world_size=a.gpus, slot_reuse=a.slot_reuse,
                  accumulate_GBps=extras.get("accumulate_GBps"))
    res = run_all(hw, opt, a.workload)
    table = format_table(res)
    if a.json:
        print(json.dumps(_jsonable(res), indent=1))
    else:
        print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "model.json"), "w") as f:
            json.dump(_jsonable(res), f, indent=1)
        with open(os.path.join(a.out, "model.txt"), "w") as f:
            f.write(table + "\n")
        for p in write_plots(res, a.out):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
