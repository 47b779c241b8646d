"""The machine a measurement ran on, in one line: CPU model, torch's CPU capability, the
cores this process may use, the torch version, and whether bf16 matrix multiplication is
native here or emulated (measured, not guessed from flags: oneDNN may be limited below what
the CPU has, e.g. ONEDNN_MAX_CPU_ISA=AVX2).

Every table the demo and the benchmarks print starts with this line, so that a figure is
never read without the machine it came from.
"""
from __future__ import annotations

import os
import time

# A bf16 matmul slower than fp32 by more than this is emulated: native bf16 (AVX512-BF16,
# AMX) is faster than fp32; emulation through fp32 conversion is many times slower.
EMULATED_BF16_SLOWDOWN = 1.5


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "unknown CPU"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def matmul_ms(m=128, k=512, n=1536, reps=15) -> tuple[float, float]:
    """Single-thread time (ms) of an (m x k) @ (k x n) matmul in fp32 and in bf16: the
    fastest of `reps`, since other processes on the cores (a benchmark's other ranks) only
    ever add time; a median of five called bf16 native and emulated on one VM by turns."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            x @ y  # warm-up: oneDNN picks and JITs its kernel
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                x @ y
                times.append(time.perf_counter() - t0)
            out.append(min(times) * 1e3)
        return out[0], out[1]
    finally:
        torch.set_num_threads(threads)


def describe() -> dict:
    import torch

    fp32_ms, bf16_ms = matmul_ms()
    return dict(cpu=cpu_model(), capability=torch.backends.cpu.get_cpu_capability(),
                cores=usable_cores(), torch=torch.__version__, fp32_matmul_ms=fp32_ms,
                bf16_matmul_ms=bf16_ms, bf16_emulated=bf16_ms > EMULATED_BF16_SLOWDOWN * fp32_ms)


def line(m: dict) -> str:
    bf16 = "emulated" if m["bf16_emulated"] else "native"
    return (f"machine: {m['cpu']}, torch CPU capability {m['capability']}, {m['cores']} cores, "
            f"torch {m['torch']}, bf16 matmul {bf16} "
            f"({m['bf16_matmul_ms']:.2f} ms vs {m['fp32_matmul_ms']:.2f} ms in fp32)")
