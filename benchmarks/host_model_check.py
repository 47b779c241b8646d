"""The host transport's cost model (python/tide/bench/model.py) against a measurement on this
machine: 16 MiB per rank, 2 ranks, one copy thread per rank (the model's assumption),
predicted and measured all-gather and reduce-scatter times side by side. A benchmark, not a
test: on a machine shared with other work the measurement says nothing about the model.

    scripts/env python benchmarks/host_model_check.py
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

NBYTES, WS, REPS = 16 << 20, 2, 5


def memcpy_GBps(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Single-thread copy of nbytes: bytes copied per second (best of reps)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def collectives(rank, world_size, nbytes, reps):
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    inp, out = torch.ones(n), torch.empty(n * world_size)
    rs_in, rs_out = torch.ones(n * world_size), torch.empty(n)
    times = {"ag": math.inf, "rs": math.inf}
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, inp)
        times["ag"] = min(times["ag"], time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(rs_out, rs_in)
        times["rs"] = min(times["rs"], time.perf_counter() - t0)
    return times


def main():
    os.environ["TIDE_NUM_THREADS"] = "1"  # the model: one core per rank
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    from dist_harness import run_ranks

    import tide.bench.model as M

    bw = memcpy_GBps()
    res = run_ranks(collectives, WS, NBYTES, REPS, backend="tide", timeout=120)
    print(f"host transport, {WS} ranks, {NBYTES >> 20} MiB per rank, single-thread memcpy {bw:.2f} GB/s")
    print(f"{'op':16}{'predicted':>12}{'measured':>12}{'predicted / measured':>24}")
    for op, key, predict in (("all_gather", "ag", M.host_allgather_time),
                             ("reduce_scatter", "rs", M.host_reducescatter_time)):
        pred, meas = predict(NBYTES, WS, bw), max(r[key] for r in res)
        print(f"{op:16}{pred * 1e3:>9.2f} ms{meas * 1e3:>9.2f} ms{pred / meas:>24.2f}")


if __name__ == "__main__":
    main()
