"""The demo's account of a step (tide/demo.py): peer wait against hand-computed cases, a
real straggler on real ranks, the collectives it attributes against the profiler's own
backend ranges, and `python -m tide.demo` end to end (machine line, table, PNG, no noise),
and a configure step without torch's CUDA warning."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dist_harness import run_ranks, slack

MS = 1_000_000  # ns


def record(*seams):
    return dict(copies_ms=0.0, optimizer_ms=0.0, seams=[(k, f"FSDP::{k} ({i})", t, ms)
                                                        for i, (k, t, ms) in enumerate(seams)])


def test_peer_wait_by_hand():
    from tide.demo import peer_wait_ms

    # Rank 1 arrives at the all-gather 30 ms after rank 0 and at the reduce-scatter 5 ms before.
    r0 = record(("all_gather", 0, 50.0), ("copy_out", 60 * MS, 2.0), ("reduce_scatter", 105 * MS, 9.0))
    r1 = record(("all_gather", 30 * MS, 20.0), ("copy_out", 55 * MS, 2.0), ("reduce_scatter", 100 * MS, 14.0))
    assert peer_wait_ms([r0, r1]) == pytest.approx([30.0, 5.0])
    # A wait never exceeds the time spent in the collective (here 10 ms, not 30).
    r0 = record(("all_gather", 0, 10.0))
    r1 = record(("all_gather", 30 * MS, 4.0))
    assert peer_wait_ms([r0, r1]) == pytest.approx([10.0, 0.0])
    # Copy-outs do not meet the other ranks: never counted as waits.
    assert peer_wait_ms([record(("copy_out", 0, 5.0)), record(("copy_out", 9 * MS, 5.0))]) == [0.0, 0.0]
    # Collectives that do not pair up (another kind, or another module's): no claim.
    assert peer_wait_ms([record(("all_gather", 0, 1.0)), record(("reduce_scatter", 0, 1.0))]) is None
    other = record(("all_gather", 0, 1.0))
    other["seams"][0] = ("all_gather", "FSDP::all_gather (layers.7)", 0, 1.0)
    assert peer_wait_ms([record(("all_gather", 0, 1.0)), other]) is None


def test_breakdown_by_hand():
    from tide.demo import breakdown

    r0 = dict(copies_ms=7.0, optimizer_ms=3.0, seams=[("all_gather", "FSDP::all_gather", 0, 40.0)])
    r1 = dict(copies_ms=5.0, optimizer_ms=5.0, seams=[("all_gather", "FSDP::all_gather", 25 * MS, 20.0)])
    b = breakdown([100.0, 120.0], [r0, r1])
    assert b["waiting for a slower peer"] == pytest.approx(12.5)
    assert b["exposed communication"] == pytest.approx(30.0 - 12.5)
    assert b["compute"] == pytest.approx(110.0 - 30.0 - 6.0 - 4.0)


def straggler_worker(rank, ws, straggle_ms):
    """FSDP2 steps with every step profiled; rank 1 sleeps after its forward, so the other
    ranks wait for it at the first all-gather of the backward."""
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    from tide.demo import SEAMS, breakdown, step_record
    from tide.models import LlamaConfig, TinyLlama, loss_fn, make_batch

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=93)
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        tokens = make_batch(cfg, 2, 16, step, rank)
        torch.distributed.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            loss = loss_fn(model, tokens)
            if rank == 1:
                time.sleep(straggle_ms / 1e3)
            loss.backward()
            opt.step()
            opt.zero_grad()
            wall = (time.perf_counter() - start) * 1e3
        events = prof.events()
        rec = step_record(events, prof.profiler.kineto_results.trace_start_ns())
        # The backend's own ranges: tide runs FSDP2's collectives on the calling thread,
        # so each must lie within one of FSDP2's seams, where the demo counts it.
        seams = [e.time_range for e in events if e.name.split(" (")[0] in SEAMS]
        backend = [e.time_range for e in events if e.name.startswith("tide:")]
        outside = [(r.start, r.end) for r in backend
                   if not any(s.start <= r.start and r.end <= s.end for s in seams)]
        names = {e.name.split(" (")[0] for e in events}
        out.append(dict(rec=rec, wall=wall, backend_ranges=len(backend), outside=outside,
                        names=names, alone=breakdown([wall], [rec])))
    return out


@pytest.mark.parametrize("backend", ["tide", "gloo"])
def test_a_straggler_is_peer_wait_not_communication(backend):
    from tide.demo import PARTS, breakdown, peer_wait_ms

    straggle = 500.0
    res = run_ranks(straggler_worker, 2, straggle, backend=backend, timeout=slack(60))
    for step in (1, 2):  # the first step includes lazy initialisation
        recs = [res[r][step]["rec"] for r in range(2)]
        waits = peer_wait_ms(recs)
        assert waits is not None, "every rank runs the same collectives"
        # Rank 0 waited about `straggle` at the backward's first all-gather, rank 1 hardly.
        assert 0.6 * straggle <= waits[0] <= straggle + slack(50), waits
        assert waits[1] < 0.4 * straggle, waits
        b = breakdown([res[r][step]["wall"] for r in range(2)], recs)
        assert all(b[p] >= 0 for p in PARTS), b
        comm0 = sum(s[3] for s in recs[0]["seams"])
        assert comm0 - waits[0] < 0.3 * straggle, (comm0, waits)  # the rest is small
        # Without the peer wait split off, rank 0's communication would hold the sleep.
        assert res[0][step]["alone"]["exposed communication"] >= 0.6 * straggle
        if backend == "tide":
            for r in range(2):
                assert res[r][step]["backend_ranges"] > 0
                assert not res[r][step]["outside"], res[r][step]["outside"]
                assert recs[r]["copies_ms"] == 0.0
        else:
            # Stock FSDP2: the copies are there and counted.
            assert {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy"} <= res[0][step]["names"]
            assert all(recs[r]["copies_ms"] > 0 for r in range(2))


def test_configure_is_quiet(tmp_path):
    """CMake's configure step imports torch.utils.cpp_extension, which warns "No CUDA
    runtime is found" on every machine without a GPU: the build keeps that to itself."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    p = subprocess.run(["cmake", "-S", root, "-B", str(tmp_path / "build"), "-G", "Ninja",
                        f"-DTIDE_NCCL_HINT={os.environ.get('TIDE_NCCL_HINT', '')}",
                        f"-DPython3_EXECUTABLE={sys.executable}"],
                       capture_output=True, text=True, timeout=slack(120))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No CUDA runtime" not in p.stdout + p.stderr, p.stderr


def test_demo_end_to_end(tmp_path):
    """`python -m tide.demo` on two ranks for two steps: the machine line, the breakdown,
    the losses of tide bitwise equal to stock FSDP2 on gloo in fp32 and in bf16 mixed
    precision, ratios to stock in the same precision, the PNG, and none of torch's or
    kineto's noise."""
    png = tmp_path / "demo.png"
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "TIDE_DEBUG")}
    p = subprocess.run([sys.executable, "-m", "tide.demo", "--steps", "2", "--batch", "1",
                        "--seq", "16", "--plot", str(png)], env=env, capture_output=True,
                       text=True, timeout=slack(200))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "machine: " in out and "torch CPU capability" in out and "bf16 matmul" in out, out
    assert out.count("where the time goes") == 4 and "what TIDE changes:" in out, out
    assert "ratio to stock FSDP2 on gloo in the same precision" in out, out
    assert "compute share" in out, out
    copies = next(line for line in out.splitlines() if "FSDP2 layout copies (ms/step)" in line)
    assert copies.count("0.0 (0.00x)") == 2, copies  # both tide columns copy nothing
    for noise in ("USDT", "No CUDA runtime", "Warning", "warn"):
        assert noise not in out, f"{noise!r} in the demo's output:\n{out}"
    losses = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))
              and len(line.split()) == 5]
    # columns: stock fp32, tide fp32, stock bf16, tide bf16
    assert len(losses) == 2 and all(row[1] == row[2] and row[3] == row[4] for row in losses), losses
    assert any(row[1] != row[3] for row in losses), losses  # bf16 is not fp32
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in out


def test_machine_line_says_bf16_is_emulated_where_onednn_is_held_to_avx2():
    """The bf16 verdict is measured: with oneDNN and torch held to AVX2 (no bf16 matmul
    instructions there) a bf16 matmul is emulated, many times slower than fp32."""
    code = ("import json; from tide.machine import describe, line; d = describe(); "
            "print(json.dumps(d)); print(line(d))")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=slack(60))
    assert p.returncode == 0, p.stderr
    import json

    d = json.loads(p.stdout.splitlines()[0])
    assert d["capability"] == "AVX2" and d["bf16_emulated"], d
    assert d["bf16_matmul_ms"] > 3 * d["fp32_matmul_ms"], d
    assert "bf16 matmul emulated" in p.stdout.splitlines()[1]
