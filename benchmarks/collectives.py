"""All-gather and reduce-scatter bandwidth of tide and gloo, side by side, in one run.

Prints nccl-tests-style tables (size, count, type, time, algbw, busbw) per world size and
the tide/gloo ratio, plus the single-thread memcpy bandwidth measured in the same run.
Sizes are per rank: the all-gather input, the reduce-scatter output. As in nccl-tests,
"size" is the whole buffer (all-gather output, reduce-scatter input), algbw = size / time
and busbw = algbw * (n - 1) / n.

    scripts/env python benchmarks/collectives.py [--world-sizes 2 4] [--max-bytes 256M]
        [--json rows.json] [--plot bandwidth.png]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))


def parse_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def sizes_between(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def timed(fn, iters=5):
    fn()  # warm-up (first touch of buffers, shared-memory mapping)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]  # median


def agreed_iters(fn, sync, min_time=0.3, lo=3, hi=100):
    """Every rank must run the same number of iterations: time one call, agree on the
    slowest rank's time, and derive the count from it."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(lo, min(hi, int(min_time / max(sync(time.perf_counter() - t0), 1e-9))))


def memcpy_gbps(nbytes=64 << 20):
    import torch

    torch.set_num_threads(1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters=9)
    return nbytes / t / 1e9


def rank_main(rank, ws, init_file, per_rank_sizes, queue):
    os.environ.setdefault("USE_LIBUV", "0")
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("tide", init_method=f"file://{init_file}", rank=rank,
                            world_size=ws, timeout=timedelta(seconds=600))
    groups = {"tide": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["tide"])
        return t.item()
    rows = []
    for nbytes in per_rank_sizes:
        count = nbytes // 4
        x = torch.randn(count)
        ag_out = torch.empty(count * ws)
        rs_in = torch.randn(count * ws)
        rs_out = torch.empty(count)
        for name, group in groups.items():
            def ag():
                dist.all_gather_into_tensor(ag_out, x, group=group)

            def rs():
                dist.reduce_scatter_tensor(rs_out, rs_in, group=group)

            for op, fn in (("all_gather", ag), ("reduce_scatter", rs)):
                iters = agreed_iters(fn, slowest)
                dist.barrier(group=groups["tide"])
                # Every rank measures; the slowest rank's median is the collective's time.
                tt = torch.tensor([slowest(timed(fn, iters))], dtype=torch.float64)
                rows.append(dict(op=op, impl=name, per_rank_bytes=nbytes, count=count * ws,
                                 time_s=tt.item(), size=nbytes * ws))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def run(ws, per_rank_sizes):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, ws, os.path.join(tmp, "s"),
                                                     per_rank_sizes, queue)) for r in range(ws)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=3600)
        for p in procs:
            p.join()
    return rows


def fmt_size(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def print_table(ws, rows, memcpy):
    print(f"\n# world size {ws}; single-thread memcpy in this run: {memcpy:.2f} GB/s")
    for op in ("all_gather", "reduce_scatter"):
        print(f"#\n# {op} (float32; size = {'output' if op == 'all_gather' else 'input'} "
              f"bytes per rank)")
        print(f"# {'size':>8} {'count':>11} {'type':>6}  {'tide us':>10} {'algbw':>7} {'busbw':>7}"
              f"  {'gloo us':>10} {'algbw':>7} {'busbw':>7}  {'tide/gloo':>9} {'tide/memcpy':>11}")
        by = {(r["impl"], r["per_rank_bytes"]): r for r in rows if r["op"] == op}
        for nbytes in sorted({r["per_rank_bytes"] for r in rows}):
            t, g = by[("tide", nbytes)], by[("gloo", nbytes)]
            cells = []
            for r in (t, g):
                alg = r["size"] / r["time_s"] / 1e9
                cells.append((r["time_s"] * 1e6, alg, alg * (ws - 1) / ws))
            speedup = g["time_s"] / t["time_s"]
            print(f"  {fmt_size(t['size']):>8} {t['count']:>11} {'float':>6}  "
                  f"{cells[0][0]:>10.1f} {cells[0][1]:>7.2f} {cells[0][2]:>7.2f}  "
                  f"{cells[1][0]:>10.1f} {cells[1][1]:>7.2f} {cells[1][2]:>7.2f}  "
                  f"{speedup:>8.2f}x {cells[0][1] / memcpy:>10.2f}x")


def write_plot(results, memcpy, machine_line, path):
    """Bus bandwidth against size, one panel per collective, tide and gloo at each world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, op in zip(axes, ("all_gather", "reduce_scatter")):
        for ws, rows in results.items():
            for impl, style in (("tide", "-o"), ("gloo", "--s")):
                pts = sorted((r["size"], r["size"] / r["time_s"] / 1e9 * (ws - 1) / ws)
                             for r in rows if r["op"] == op and r["impl"] == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=3,
                        label=f"{impl}, {ws} ranks")
        ax.axhline(memcpy, color="gray", linewidth=0.8, linestyle=":", label="1-thread memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes: all-gather output / reduce-scatter input)")
        ax.set_title(f"{op} (float32)")
        ax.grid(True, which="major", linewidth=0.3)
    axes[0].set_ylabel("bus bandwidth (GB/s)")
    axes[0].legend(fontsize=8)
    fig.suptitle(machine_line, fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--plot", help="also write a bandwidth-vs-size PNG here")
    args = ap.parse_args(argv)
    sizes = list(sizes_between(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)))
    from tide.machine import describe, line

    machine = describe()
    print(f"# {line(machine)}")
    memcpy = memcpy_gbps()
    results = {}
    for ws in args.world_sizes:
        results[ws] = run(ws, sizes)
        print_table(ws, results[ws], memcpy)
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "memcpy_GBps": memcpy, "results": results}, f, indent=1)
    if args.plot:
        write_plot(results, memcpy, line(machine), args.plot)
        print(f"# plot: {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
