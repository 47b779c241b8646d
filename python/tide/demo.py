"""The main job (`make demo`): FSDP2 training of a small Llama-3-style model on CPU
processes, stock FSDP2 on gloo and then on tide, in fp32 and in bf16 mixed precision (bf16
parameters, fp32 reduction): the same numerics, so the same losses. Prints where each
step's time goes, per column and per step, the machine it ran on, a side-by-side table
(each tide column as a ratio to stock FSDP2 in the same precision), and writes the same as
a PNG.

    python -m tide.demo [--world-size 2] [--steps 8] [--plot tide_demo.png]

Where the time goes, from the profiler of every step on every rank:
- layout copies: FSDP2's copies around its collectives (`fsdp::all_gather_copy_in`,
  `fsdp::split_with_sizes_copy`, `fsdp::chunk_cat*`), the copies TIDE removes;
- communication: time inside FSDP2's collective seams (`FSDP::all_gather`,
  `FSDP::all_gather_copy_out`, `FSDP::post_backward_reduce`) less the layout copies in them:
  the collectives and the seams' own small work (stock: allocating the reduce-scatter input,
  the gradient division and cast; tide: its staging). It is split into waiting for a slower
  peer (how much later than this rank the last rank arrived at the same all-gather or
  reduce-scatter, after its layout copies, at most the time this rank spent in it: the
  clocks of the ranks' processes on one host agree) and the rest, the exposed
  communication;
- optimizer: `Optimizer.step` and `Optimizer.zero_grad`;
- compute: the rest of the step (forward, backward, FSDP2's bookkeeping).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta


@dataclass
class Run:
    label: str
    backend: str
    bf16: bool


RUNS = [
    Run("stock FSDP2 / gloo fp32", "gloo", False),
    Run("tide fp32", "tide", False),
    Run("stock FSDP2 / gloo bf16", "gloo", True),
    Run("tide bf16", "tide", True),
]
# The model: wide enough that communication is a visible share of a step on 2 cores at
# this batch (46 MB of fp32 parameters against 2 x 64 tokens per rank), small enough that
# the four runs take about a minute and a half there (more where bf16 is emulated).
MODEL = dict(dim=512, ffn_dim=1365, n_layers=4, n_heads=8, n_kv_heads=2)
COPY_OPS = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat",
            "fsdp::chunk_cat_mixed_dtype")
SEAMS = {"FSDP::all_gather": "all_gather", "FSDP::all_gather_copy_out": "copy_out",
         "FSDP::post_backward_reduce": "reduce_scatter"}
SYNCING = ("all_gather", "reduce_scatter")  # the seams in which ranks meet (CPU: sync ops)
PARTS = ("compute", "exposed communication", "waiting for a slower peer", "layout copies",
         "optimizer")


def _base(name: str) -> str:
    return name.split(" (")[0]  # FSDP2 appends " (fqn)" to its ranges


def step_record(events, trace_start_ns: int) -> dict:
    """One rank's step from its profiler events (`trace_start_ns`: the profile's start in
    the system clock, kineto_results.trace_start_ns(); event times are relative to it):
    layout-copy and optimizer time (ms) and each collective seam as (kind, FSDP2's range
    name, arrival in ns since the epoch, ms less the copies in it). The arrival is the end
    of the seam's last layout copy (FSDP2 copies in before it communicates), or its start."""
    copies_ms = optimizer_ms = 0.0
    inner = {}  # seam event id -> [copy ms, end of its last copy (us)]
    for ev in events:
        name = _base(ev.name)
        if name in COPY_OPS:
            copies_ms += ev.cpu_time_total / 1e3
            parent = ev.cpu_parent
            while parent is not None and _base(parent.name) not in SEAMS:
                parent = parent.cpu_parent
            if parent is not None:
                acc = inner.setdefault(id(parent), [0.0, 0.0])
                acc[0] += ev.cpu_time_total / 1e3
                acc[1] = max(acc[1], ev.time_range.end)
        elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            optimizer_ms += ev.cpu_time_total / 1e3
    seams = []
    for ev in events:
        if _base(ev.name) in SEAMS:
            copy_ms, copies_end = inner.get(id(ev), (0.0, 0.0))
            arrival_us = max(ev.time_range.start, copies_end)
            seams.append((SEAMS[_base(ev.name)], ev.name, trace_start_ns + int(arrival_us * 1e3),
                          ev.cpu_time_total / 1e3 - copy_ms))
    seams.sort(key=lambda s: s[2])
    return dict(copies_ms=copies_ms, optimizer_ms=optimizer_ms, seams=seams)


def peer_wait_ms(records: list[dict]) -> list[float] | None:
    """Per rank, the time spent waiting for a slower peer in one step: for the i-th
    all-gather / reduce-scatter of every rank, the last rank's arrival minus this rank's,
    within [0, this rank's time in it]. None where the ranks' seams do not pair up (the
    same FSDP2 ranges, module by module, in the same order)."""
    syncs = [[s for s in r["seams"] if s[0] in SYNCING] for r in records]
    if len({tuple(name for _, name, _, _ in s) for s in syncs}) != 1:
        return None
    waits = [0.0] * len(records)
    for i in range(len(syncs[0])):
        latest = max(s[i][2] for s in syncs)
        for r, s in enumerate(syncs):
            waits[r] += min(max((latest - s[i][2]) / 1e6, 0.0), s[i][3])
    return waits


def breakdown(step_ms: list[float], records: list[dict]) -> dict:
    """A step's parts (ms, mean over ranks) that add up to its wall time."""
    waits = peer_wait_ms(records)
    n = len(records)
    comm = sum(sum(s[3] for s in r["seams"]) for r in records) / n
    wait = sum(waits) / n if waits is not None else 0.0
    copies = sum(r["copies_ms"] for r in records) / n
    optimizer = sum(r["optimizer_ms"] for r in records) / n
    wall = sum(step_ms) / n
    return {"step": wall, "compute": wall - comm - copies - optimizer,
            "exposed communication": comm - wait, "waiting for a slower peer": wait,
            "layout copies": copies, "optimizer": optimizer, "paired": waits is not None}


def _peak_rss_reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    except OSError:
        pass


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def train(rank, ws, run: Run, steps: int, batch: int, seq: int, model_cfg: dict, init_file: str,
          queue):
    try:
        import warnings

        # torch 2.11 warns at the end of every profile that events are cleared per cycle;
        # 2.13 warns that the model's output (logits, a view from the head's matmul) would
        # lose FSDP2's hook under an in-place op, which the demo never applies to it.
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.profiler import ProfilerActivity, profile

        import tide  # noqa: F401  registers the backend
        from tide.models import LlamaConfig, TinyLlama, loss_fn, make_batch

        torch.set_num_threads(1)  # one core per rank on the 2-core build machine
        dist.init_process_group(run.backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=ws, timeout=timedelta(seconds=300))
        mesh = init_device_mesh("cpu", (ws,))
        cfg = LlamaConfig(**model_cfg)
        torch.manual_seed(0)
        model = TinyLlama(cfg)
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if run.bf16 else MixedPrecisionPolicy())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        losses, step_ms, records = [], [], []
        base_rss = _rss_kib("VmRSS")
        _peak_rss_reset()
        for step in range(steps):
            tokens = make_batch(cfg, batch, seq, step, rank)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                loss = loss_fn(model, tokens)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_ms.append((time.perf_counter() - start) * 1e3)
            records.append(step_record(prof.events(), prof.profiler.kineto_results.trace_start_ns()))
            # Every rank's loss, averaged in rank order (not by the run's own all-reduce,
            # whose order differs between backends); the gather also lines the ranks up.
            step_losses = [None] * ws
            dist.all_gather_object(step_losses, loss.item())
            losses.append(sum(step_losses) / ws)
            if rank == 0:
                print(f"  [{run.label}] step {step + 1}/{steps}  loss {losses[-1]:.4f}  "
                      f"{step_ms[-1]:.0f} ms", flush=True)
        peak_mib = (_rss_kib("VmHWM") - base_rss) / 1024
        dist.destroy_process_group()
        queue.put((rank, dict(losses=losses, step_ms=step_ms, records=records, peak_mib=peak_mib)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def run_one(run: Run, ws: int, steps: int, batch: int, seq: int, model: dict | None = None) -> dict:
    """Trains on ws spawned ranks; model: LlamaConfig's fields (default: MODEL)."""
    model = MODEL if model is None else model
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=train, args=(r, ws, run, steps, batch, seq, model,
                                                 os.path.join(tmp, "store"), queue))
                 for r in range(ws)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1200) for _ in procs)
        for p in procs:
            p.join()
    for r, res in results.items():
        if isinstance(res, str):
            raise RuntimeError(f"{run.label}: rank {r} failed:\n{res}")
    ranks = [results[r] for r in range(ws)]
    per_step = [breakdown([res["step_ms"][s] for res in ranks], [res["records"][s] for res in ranks])
                for s in range(steps)]
    measured = per_step[1:] or per_step  # the first step includes warm-up
    mean = {k: sum(b[k] for b in measured) / len(measured) for k in ("step",) + PARTS}
    return dict(losses=ranks[0]["losses"], per_step=per_step, mean=mean,
                paired=all(b["paired"] for b in per_step),
                peak_mib=sum(res["peak_mib"] for res in ranks) / ws)


SHORT = dict(zip(PARTS, ("compute", "exposed comm", "peer wait", "layout copies", "optimizer")))


def print_steps(res: dict):
    heads = ["step", "total"] + [SHORT[p] for p in PARTS]
    print("  where the time goes (ms, mean over ranks): total = " + " + ".join(heads[2:]))
    print("  " + "  ".join(f"{h:>{max(len(h), 6)}}" for h in heads))
    for s, b in enumerate(res["per_step"]):
        cells = [str(s + 1), f"{b['step']:.0f}"] + [f"{b[p]:.0f}" for p in PARTS]
        note = "  (warm-up, not in the means)" if s == 0 else ""
        print("  " + "  ".join(f"{c:>{max(len(h), 6)}}" for c, h in zip(cells, heads)) + note)
    if not res["paired"]:
        print("  (the ranks' collectives did not pair up in some steps: no peer wait there)")


def print_table(results: dict, machine: dict):
    from tide.machine import line

    labels = list(results)
    stock = results[labels[0]]
    # Each column's baseline: stock FSDP2 in the same precision (the first column if none).
    base = {lab: next((o for o in labels if o.startswith("stock") and ("bf16" in o) == ("bf16" in lab)),
                      labels[0]) for lab in labels}
    w = 26
    print("\nloss per step (mean over ranks)")
    print("step " + "".join(f"{lab:>{w}}" for lab in labels))
    steps = len(stock["losses"])
    for s in range(steps):
        print(f"{s + 1:>4} " + "".join(f"{results[lab]['losses'][s]:>{w}.6f}" for lab in labels))

    def cell(value, ref, lab):
        ratio = f" ({value / ref:.2f}x)" if base[lab] != lab and ref > 0 else ""
        return f"{value:.1f}{ratio}"

    def row(name, fn):
        print(f"{name:<38}" + "".join(f"{cell(fn(results[lab]), fn(results[base[lab]]), lab):>{w}}"
                                      for lab in labels))

    print(f"\n{line(machine)}")
    print(f"{f'means of steps 2-{steps}, over ranks':<38}" + "".join(f"{lab:>{w}}" for lab in labels))
    print("what TIDE changes:")
    row("  FSDP2 layout copies (ms/step)", lambda r: r["mean"]["layout copies"])
    row("  exposed communication (ms/step)", lambda r: r["mean"]["exposed communication"])
    row("  peak RSS growth (MiB)", lambda r: r["peak_mib"])
    print("what it does not:")
    row("  compute (ms/step)", lambda r: r["mean"]["compute"])
    row("  optimizer (ms/step)", lambda r: r["mean"]["optimizer"])
    row("  waiting for a slower peer (ms/step)", lambda r: r["mean"]["waiting for a slower peer"])
    row("step time (ms)", lambda r: r["mean"]["step"])
    print(f"{'  compute share of the step':<38}" + "".join(
        f"{100 * results[lab]['mean']['compute'] / results[lab]['mean']['step']:>{w - 1}.0f}%"
        for lab in labels))
    print("\n(x) = ratio to stock FSDP2 on gloo in the same precision (fp32 / bf16 mixed), measured in this run.")
    bf16 = [lab for lab in labels if "bf16" in lab]
    if machine["bf16_emulated"] and bf16:
        print(f"This CPU has no native bf16 matmul ({machine['capability']}; bf16 took "
              f"{machine['bf16_matmul_ms'] / machine['fp32_matmul_ms']:.0f}x fp32's time), so "
              f"the bf16 columns' compute is emulated and slow: read their layout copies "
              "and communication, not their step time.")


def write_plot(results: dict, machine: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tide.machine import line

    labels = list(results)
    colors = dict(zip(PARTS, ("#9aa5b1", "#2b6cb0", "#a3bffa", "#e53e3e", "#68d391")))
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw=dict(width_ratios=[3, 1.3]))
    bottom = [0.0] * len(labels)
    for part in PARTS:
        values = [results[lab]["mean"][part] for lab in labels]
        ax.bar(labels, values, bottom=bottom, label=part, color=colors[part])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step (mean of steps 2+, over ranks)")
    ax.set_title("where a step's time goes")
    ax.legend(fontsize=8)
    mem.bar(labels, [results[lab]["peak_mib"] for lab in labels], color="#805ad5")
    mem.set_ylabel("MiB")
    mem.set_title("peak RSS growth")
    for a in (ax, mem):
        a.tick_params(axis="x", labelsize=8, labelrotation=15)
    fig.suptitle(line(machine), fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--plot", default="tide_demo.png", help="where the PNG goes ('' for none)")
    args = ap.parse_args(argv)
    # Kineto prints a USDT line at every profiler start and stop unless its level is 6; the
    # ranks inherit this (they import torch before train() runs).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("USE_LIBUV", "0")

    from tide.machine import describe, line

    machine = describe()
    print(f"TIDE demo: FSDP2 on {args.world_size} CPU processes, {args.steps} steps, "
          f"batch {args.batch} x {args.seq} tokens per rank, model {MODEL}")
    print(line(machine) + "\n", flush=True)
    results = {}
    for run in RUNS:
        print(f"{run.label}:", flush=True)
        results[run.label] = run_one(run, args.world_size, args.steps, args.batch, args.seq)
        print_steps(results[run.label])
    print_table(results, machine)
    if args.plot:
        write_plot(results, machine, args.plot)
        print(f"\nplot: {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
