"""Across pseudo-nodes, side by side in one run, per topology:
  1. TIDE-AG and TIDE-RS across nodes (gloo between the nodes) vs gloo's own
     all_gather_into_tensor / reduce_scatter_tensor on the same bytes (time, busbw, ratio),
     and the reduce-scatter's staging as measured memory: the growth of the peak resident
     set (VmHWM, shared staging pages included) over each rank's first reduce-scatter, the
     slowest rank's, next to what the node partials take (StagingReport.partial_bytes);
  2. FSDP2 training: stock FSDP2 on a gloo group, tide fp32 and tide bf16 mixed precision.
One machine is split into nodes with TIDE_LOCAL_WORLD_SIZE: real ranks and the real
inter-node engine, but the "network" is loopback TCP on the same cores, so these ratios say
what the layout copies and the schedule cost here, not what a cluster's NICs would show
(that is the model's job).

    scripts/env python benchmarks/pseudo_nodes.py [--topologies 1x2 2x2 3x2] [--steps 6]
        [--numel 4M] [--no-fsdp]
"""
from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "python"), os.path.join(_HERE, "..", "tests", "python"), _HERE]


def _kib(line):
    return int(line.split()[1]) * 1024


def _vm(field):
    with open("/proc/self/status") as f:
        return next(_kib(line) for line in f if line.startswith(field + ":"))


def collectives_rank(rank, ws, numel):
    """TIDE-AG / TIDE-RS on one FSDP2-like group of `numel` fp32 elements (four odd-shaped
    parameters) vs gloo on the same bytes. Returns rank's measurements."""
    import torch
    import torch.distributed as dist

    import tide
    from collectives import agreed_iters, timed

    torch.set_num_threads(1)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    gloo = dist.new_group(backend="gloo")
    plan = tide._C.plan
    cols = 1000
    rows = [max(1, numel // cols * w // 10) for w in (4, 3, 2, 1)]
    layout = plan.plan_group([plan.Param([r, cols], 4, 0) for r in rows], ws)
    params = layout.params

    def packed(sizes):
        offs, total = [], 0
        for n in sizes:
            offs.append(total)
            total += (n * 4 + 255) // 256 * 256
        return offs, total

    shard_offs, shard_total = packed([lp.padded_shard_numel for lp in params])
    shards = backend.allocate_symmetric(shard_total, -1)
    for lp, off in zip(params, shard_offs):
        shards.tensor(rank, off, lp.padded_shard_numel, torch.float32).normal_()
    store_offs, store_total = packed([lp.storage_numel for lp in params])
    home = backend.allocate_symmetric(store_total, -1)  # node peers read the storages
    storages = [home.tensor(rank, off, lp.storage_numel, torch.float32) for lp, off in zip(params, store_offs)]
    grads = [torch.randn(lp.numel) for lp in params]
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    padded = [lp.padded_shard_numel for lp in params]
    out_offsets = [sum(padded[:i]) for i in range(len(padded))]
    out = torch.empty(sum(padded))
    total = sum(lp.numel for lp in params)
    per_rank = (total + ws - 1) // ws
    x, ag_out = torch.randn(per_rank), torch.empty(per_rank * ws)
    rs_in, rs_out = torch.randn(per_rank * ws), torch.empty(per_rank)

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def tide_rs():
        backend.param_reduce_scatter(layout, grads, out, out_offsets, dist.ReduceOp.SUM).wait()

    # Staging as measured memory: the peak resident set's growth over the first TIDE-RS.
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _vm("VmRSS")
    tide_rs()
    rs_growth = _vm("VmHWM") - before
    result = dict(total=total, rs_peak_growth=slowest(rs_growth),
                  partial_bytes=backend.last_staging_report().partial_bytes,
                  inter_node_bytes=0)
    runs = {
        ("all_gather", "tide"): lambda: backend.param_all_gather(layout, shards, shard_offs, torch.float32,
                                                                 storages).wait(),
        ("all_gather", "gloo"): lambda: dist.all_gather_into_tensor(ag_out, x, group=gloo),
        ("reduce_scatter", "tide"): tide_rs,
        ("reduce_scatter", "gloo"): lambda: dist.reduce_scatter_tensor(rs_out, rs_in, group=gloo),
        # FSDP2's bf16 mixed precision with fp32 reduction: stock widens the bf16 gradients and
        # reduce-scatters fp32 (the gloo row above, widening not counted); TIDE-RS reads the
        # bf16 gradients and writes fp32 shards.
        ("reduce_scatter_bf16", "tide"): lambda: backend.param_reduce_scatter(layout, grads_bf16, out, out_offsets,
                                                                              dist.ReduceOp.SUM).wait(),
    }
    for key, fn in runs.items():
        iters = agreed_iters(fn, slowest, min_time=0.5)
        dist.barrier()
        result[key] = slowest(timed(fn, iters))
    result["inter_node_bytes"] = backend.inter_node_bytes_sent()
    return result


def print_collectives(nodes, local, r):
    ws = nodes * local
    size = r["total"] * 4
    print(f"collectives: one group of {r['total']} fp32 elements ({size / 2**20:.1f} MiB unsharded), "
          f"busbw = size / time x (n - 1) / n")
    print(f"  {'op':<15} {'gloo ms':>9} {'tide ms':>9} {'gloo busbw':>11} {'tide busbw':>11} {'tide/gloo time':>15}")
    for op, gloo_op, label in (("all_gather", "all_gather", "all_gather"),
                               ("reduce_scatter", "reduce_scatter", "reduce_scatter"),
                               ("reduce_scatter_bf16", "reduce_scatter", "rs bf16->fp32*")):
        g, t = r[(gloo_op, "gloo")], r[(op, "tide")]
        bw = [size / s * (ws - 1) / ws / 1e9 for s in (g, t)]
        print(f"  {label:<15} {g * 1e3:9.2f} {t * 1e3:9.2f} {bw[0]:8.2f} GB/s {bw[1]:8.2f} GB/s {t / g:14.2f}x")
    print("  * bf16 gradients, fp32 shards (FSDP2's mixed precision): tide reads the bf16 gradients; "
          "gloo's column is its fp32 reduce-scatter, which stock FSDP2 runs after widening them")
    print(f"  reduce-scatter staging: peak resident growth over the first TIDE-RS "
          f"{r['rs_peak_growth'] / 2**20:.2f} MiB (slowest rank); node partials "
          f"{r['partial_bytes'] / 2**20:.2f} MiB per rank", flush=True)


def main(argv=None):
    from dist_harness import run_ranks
    from tide import demo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", nargs="+", default=["1x2", "2x1", "2x2", "3x2"], help="NODESxRANKS_PER_NODE")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--numel", default="4M", help="elements of the collectives' group (K/M suffix)")
    ap.add_argument("--no-fsdp", action="store_true", help="the collectives only")
    args = ap.parse_args(argv)
    from collectives import parse_bytes

    from tide.machine import describe, line

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no USDT line at each profiler start/stop
    machine = describe()
    print(line(machine))
    for topo in args.topologies:
        nodes, local = (int(x) for x in topo.split("x"))
        ws = nodes * local
        os.environ["TIDE_LOCAL_WORLD_SIZE"] = str(local)  # the rank processes inherit it
        print(f"\n== {nodes} pseudo-node{'s' if nodes > 1 else ''} x {local} ranks (world size {ws})",
              flush=True)
        r = run_ranks(collectives_rank, ws, parse_bytes(args.numel), timeout=1800, pg_timeout_s=600)[0]
        print_collectives(nodes, local, r)
        if args.no_fsdp:
            continue
        print(f"FSDP2: {args.steps} steps, batch {args.batch} x {args.seq} tokens per rank", flush=True)
        # The model of the tests (LlamaConfig's defaults), not the demo's wider one.
        results = {run.label: demo.run_one(run, ws, args.steps, args.batch, args.seq, model={})
                   for run in demo.RUNS}
        demo.print_table(results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
