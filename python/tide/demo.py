"""The main job (`make demo`): FSDP2 training of a small Llama-3-style model on CPU
processes, first stock FSDP2 on gloo, then on tide (fp32, the same numerics), then tide
with bf16 mixed precision (which stock FSDP2 cannot run on CPU: gloo has no bf16
all-gather). Ends with a side-by-side table.

    python -m tide.demo [--world-size 2] [--steps 8]
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
    Run("tide bf16 mixed", "tide", True),
]
# Profiler ranges that are collectives (tide:*, gloo:*) or FSDP2's layout copies (fsdp::*).
COPY_OPS = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")


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


def train(rank, ws, run: Run, steps: int, batch: int, seq: int, init_file: str, queue):
    try:
        os.environ.setdefault("USE_LIBUV", "0")
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no GPU-probe noise from the profiler
        import warnings

        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.profiler import ProfilerActivity, profile

        import tide  # noqa: F401  registers the backend
        from tide.models import LlamaConfig, TinyLlama, loss_fn, make_batch

        torch.set_num_threads(1)  # one core per rank on the 2-core build machine
        dist.init_process_group(run.backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=ws, timeout=timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (ws,))
        cfg = LlamaConfig()
        torch.manual_seed(0)
        model = TinyLlama(cfg)
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if run.bf16 else MixedPrecisionPolicy())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

        losses, times, comm_ms, copy_ms = [], [], 0.0, 0.0
        base_rss = _rss_kib("VmRSS")
        _peak_rss_reset()
        for step in range(steps):
            tokens = make_batch(cfg, batch, seq, step, rank)
            profiled = step == steps - 1
            prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
            if prof:
                prof.__enter__()
            start = time.perf_counter()
            loss = loss_fn(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            if prof:
                prof.__exit__(None, None, None)
                for ev in prof.events():
                    if ev.name.startswith(("tide:", "gloo:")):
                        comm_ms += ev.cpu_time_total / 1e3
                    elif ev.name in COPY_OPS:
                        copy_ms += ev.cpu_time_total / 1e3
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / ws)
            if rank == 0:
                print(f"  [{run.label}] step {step + 1}/{steps}  loss {losses[-1]:.4f}  "
                      f"{times[-1] * 1e3:.0f} ms", flush=True)
        peak_mib = (_rss_kib("VmHWM") - base_rss) / 1024
        dist.destroy_process_group()
        queue.put((rank, dict(losses=losses, times=times, comm_ms=comm_ms, copy_ms=copy_ms,
                              peak_mib=peak_mib)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def run_one(run: Run, ws: int, steps: int, batch: int, seq: int):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=train, args=(r, ws, run, steps, batch, seq,
                                                 os.path.join(tmp, "store"), queue))
                 for r in range(ws)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
    for r, res in results.items():
        if isinstance(res, str):
            raise RuntimeError(f"{run.label}: rank {r} failed:\n{res}")
    return results[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)

    print(f"TIDE demo: FSDP2 on {args.world_size} CPU processes, {args.steps} steps, "
          f"batch {args.batch} x {args.seq} tokens per rank\n", flush=True)
    results = {}
    for run in RUNS:
        print(f"{run.label}:", flush=True)
        results[run.label] = run_one(run, args.world_size, args.steps, args.batch, args.seq)
    print_table(results, args.steps)


def print_table(results, steps):
    labels = list(results)
    stock = results[labels[0]]
    w = 26
    print("\nloss per step (mean over ranks)")
    print("step " + "".join(f"{lab:>{w}}" for lab in labels))
    for s in range(steps):
        print(f"{s + 1:>4} " + "".join(f"{results[lab]['losses'][s]:>{w}.6f}" for lab in labels))

    def mean_step(res):
        t = res["times"][1:] or res["times"]  # the first step includes warm-up
        return sum(t) / len(t) * 1e3

    rows = [
        ("step time (ms, mean of steps 2+)", mean_step),
        ("collectives (ms, last step)", lambda r: r["comm_ms"]),
        ("FSDP2 layout copies (ms, last step)", lambda r: r["copy_ms"]),
        ("peak RSS growth (MiB)", lambda r: r["peak_mib"]),
    ]
    print("\n" + " " * 36 + "".join(f"{lab:>{w}}" for lab in labels))
    for name, fn in rows:
        cells = []
        for lab in labels:
            v = fn(results[lab])
            ratio = f" ({v / fn(stock):.2f}x)" if lab != labels[0] and fn(stock) > 0 else ""
            cells.append(f"{v:.1f}{ratio}")
        print(f"{name:<36}" + "".join(f"{c:>{w}}" for c in cells))
    print("\n(x) = ratio to stock FSDP2 on gloo, measured in this run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
