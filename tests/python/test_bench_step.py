"""`torchrun ... -m tide.bench.step` (the paper's experiment): its models are the step-time
model's workloads parameter for parameter, and a short run of each model on two ranks
trains the same losses as stock FSDP2 over gloo (bitwise: two ranks sum in one order),
with TIDE's zero-copy path taken and stock's not, on one node and across pseudo-nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_harness import slack


def _unit_shapes(module, blocks):
    """(root's parameter shapes, [each block's]) in registration order, as fully_shard
    groups them (the root unit owns what no block owns)."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [tuple(p.shape) for p in module.parameters() if id(p) not in in_blocks]
    return root, [[tuple(p.shape) for p in b.parameters()] for b in blocks]


@pytest.mark.parametrize("name", ["llama3.1-70b", "qwen3-30b-a3b", "wan2.2-14b"])
@pytest.mark.parametrize("layers,divisor", [(None, 1), (2, 8), (1, 40)])
def test_nets_are_the_model_workloads(name, layers, divisor):
    """Every FSDP unit of the module has the parameter shapes, in order, that the step-time
    model counts for the same workload: full size (on the meta device) and scaled."""
    import torch

    from tide.bench import nets
    from tide.bench import workloads as wl

    if name != "wan2.2-14b" and divisor == 40:
        divisor = 32  # Llama's 64 heads, Qwen3's 32: 40 does not divide them
    shape = wl.scaled(wl.SHAPES[name], layers, divisor)
    with torch.device("meta"):
        module = nets.BUILDERS[name](shape)
    workload = wl.WORKLOADS[name](shape=shape)
    root, blocks = _unit_shapes(module, list(module.layers))
    assert root == [tuple(s) for s in workload.root.params]
    assert blocks == [[tuple(s) for s in u.params] for u in workload.blocks]
    assert sum(p.numel() for p in module.parameters()) == workload.numel
    if layers is None and divisor == 1:
        assert workload.name == name
    else:
        assert workload.name.startswith(f"{name} ({shape['layers']} layer")


def test_scaling_keeps_the_head_dimension_and_says_what_divides():
    from tide.bench import workloads as wl

    s = wl.scaled(wl.LLAMA31_70B, 2, 32)
    assert (s["d"], s["ffn"], s["heads"], s["kv"], s["hd"], s["vocab"], s["layers"]) == (256, 896, 2, 1, 128, 4008, 2)
    with pytest.raises(ValueError, match=r"hidden divisor 3 must divide the 64 attention heads.*\[1, 2, 4, 8"):
        wl.scaled(wl.LLAMA31_70B, None, 3)
    with pytest.raises(ValueError, match="layers must be at least 1"):
        wl.scaled(wl.WAN22_14B, 0, 1)


def _bench(tmp_path, nproc, args, env_extra=None, timeout=240):
    out = tmp_path / "step.json"
    png = tmp_path / "step.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tide.bench.step", "--device", "cpu", "--steps", "2", "--warmup", "1", "--rounds", "1", "--json", str(out),
           "--png", str(png), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=slack(timeout))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text()), p.stdout


def _check_against_stock(report, precisions, impls=("tide",)):
    res = report["results"]
    for prec in precisions:
        stock = res[f"stock-{prec}"]
        assert stock["paths"]["zero_copy_all_gather"] == 0 and stock["paths"]["stock_all_gather"] > 0
        for impl in impls:
            r = res[f"{impl}-{prec}"]
            # Stock FSDP2 over gloo is the reference: same weights, batches, steps.
            assert r["losses"] == stock["losses"], (impl, prec)
            assert r["paths"]["zero_copy_all_gather"] > 0 and r["paths"]["zero_copy_reduce_scatter"] > 0
            assert r["paths"]["stock_all_gather"] == r["paths"]["stock_reduce_scatter"] == 0
            assert r["step_ms"]["median"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
            assert r["breakdown"]["layout copies"] == 0.0 < stock["breakdown"]["layout copies"]
        assert len(set(stock["losses"])) > 1  # the losses move: the steps train
    _check_cpu(report)


def _check_cpu(report):
    """Every variant's CPU per step: its ranks compute (user time), and the floor, their CPU
    over the host's cores, cannot exceed the wall time the cores had in the step (the step
    windows start together after a barrier; slack for their ends)."""
    for key, r in report["results"].items():
        if "step_ms" not in r:
            continue
        c = r["cpu"]
        assert c["hosts"] == 1 and c["cores"] == len(os.sched_getaffinity(0)), (key, c)
        assert c["user_ms"] > 0 and c["system_ms"] >= 0, (key, c)
        assert 0 < c["floor_ms"] <= 1.25 * r["step_ms"]["max"] + 1.0, (key, c, r["step_ms"])


def test_llama_on_one_node_every_variant(tmp_path):
    """The issue's command, shrunk: every variant in fp32 and bf16; best-configured FSDP2 is
    named as not run on CPU, with why; the bound runs the same model with no collective."""
    report, out = _bench(tmp_path, 2, ["--model", "llama3.1-70b", "--layers", "1", "--hidden-divisor", "64",
                                       "--tokens-per-gpu", "32", "--rounds", "2"])
    _check_against_stock(report, ("fp32", "bf16"), impls=("tide", "tide-slot-reuse"))
    assert "for CUDA devices" in report["results"]["best-fp32"]["skipped"]
    res = report["results"]
    for prec in ("fp32", "bf16"):
        bound = res[f"bound-{prec}"]
        # No collective of FSDP2's, no layout copy; and the same model on the same data:
        # its first step (before any update) computes stock's first loss.
        assert not any(bound["paths"].values()), bound["paths"]
        assert bound["breakdown"]["exposed communication"] == bound["breakdown"]["layout copies"] == 0.0
        assert bound["breakdown"]["optimizer"] > 0 and bound["step_ms"]["median"] > 0
    assert res["bound-fp32"]["losses"][0] == res["stock-fp32"]["losses"][0]
    # bf16: FSDP2's policy also casts the blocks' floating inputs (the RoPE tables) to bf16
    assert abs(res["bound-bf16"]["losses"][0] - res["stock-bf16"]["losses"][0]) < 2e-2
    assert report["run"]["nodes"] == 1 and report["run"]["world_size"] == 2
    # Two rounds, the variants taking turns: each variant's timed steps of both rounds, its
    # losses (the first round's) the same as stock's as checked above.
    assert report["run"]["rounds"] == 2 and "(round 2 of 2)" in out
    assert all(len(r["step_ms"]["per_step"]) == 4 for r in res.values() if "step_ms" in r)
    # Each round trains afresh from the same weights on the same batches: the same losses.
    for key, r in res.items():
        if "round_losses" in r:
            assert len(r["round_losses"]) == 2 and r["round_losses"][1] == r["round_losses"][0] == r["losses"], key
    assert out.index("running TIDE fp32 (round 1 of 2)") < out.index("running stock FSDP2 / gloo fp32 (round 2 of 2)")
    assert report["prediction"]["params"] == report["run"]["params"]
    for words in ("AdamW (fused)", "stock FSDP2 / gloo fp32", "TIDE bf16", "bound: no communication fp32", "vs stock (same precision)", "step-time model",
                  "the paper (64 GPUs", "machine: "):
        assert words in out, out


@pytest.mark.one_torch
def test_moe_across_pseudo_nodes(tmp_path):
    """Qwen3-30B-A3B's MoE blocks over two pseudo-nodes of one rank (gloo between them), with
    the multi-tensor AdamW (the other tests run the default, fused)."""
    report, out = _bench(tmp_path, 2, ["--model", "qwen3-30b-a3b", "--layers", "1", "--hidden-divisor", "32",
                                       "--tokens-per-gpu", "32", "--variants", "stock", "tide", "--precision", "fp32",
                                       "--optimizer", "foreach"],
                         env_extra={"TIDE_LOCAL_WORLD_SIZE": "1"})
    assert report["run"]["nodes"] == 2
    assert report["run"]["optimizer"] == "foreach" and "AdamW (foreach)" in out
    _check_against_stock(report, ("fp32",))


def test_dit_in_bf16(tmp_path):
    """The Wan2.2-like DiT (cross-attention to text, adaLN) in bf16 mixed precision."""
    report, _ = _bench(tmp_path, 2, ["--model", "wan2.2-14b", "--layers", "1", "--hidden-divisor", "40",
                                     "--tokens-per-gpu", "32", "--variants", "stock", "tide", "--precision", "bf16"])
    _check_against_stock(report, ("bf16",))


def test_calibrate_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --calibrate measures it (tests/gpu/run.sh)")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    p = subprocess.run([sys.executable, "-m", "tide.bench.step", "--calibrate", str(tmp_path / "c.json")],
                       env=env, capture_output=True, text=True, timeout=slack(60))
    assert p.returncode == 2 and "the step-time model is of NVIDIA GPUs" in p.stderr, p.stderr


def test_gpu_trace_account_by_hand(tmp_path):
    """The GPU report's exposed communication and SMs from a trace (the profiler's chrome
    trace, written by hand here): communication is NCCL's and TIDE's kernels and device
    copies off the compute stream; what overlaps a compute kernel is hidden."""
    from tide.bench.step import _gpu_profile

    def kernel(name, ts, dur, tid, grid=(1, 1, 1)):
        return dict(cat="kernel", name=name, ts=ts, dur=dur, tid=tid, args=dict(grid=list(grid)))

    events = [kernel("sm90_gemm", 0, 100, 7, (132, 1, 1)), kernel("sm90_gemm", 150, 50, 7, (132, 1, 1)),
              kernel("ncclDevKernel_ReduceScatter_Sum_f32", 90, 70, 20, (16, 1, 1)),
              kernel("void tide::cuda::(anonymous namespace)::accumulate_kernel<float>", 500, 10, 21, (200, 1, 1)),
              dict(cat="gpu_memcpy", name="Memcpy PtoP (Device -> Device)", ts=300, dur=50, tid=30),
              dict(cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", ts=400, dur=10, tid=7),
              dict(cat="cpu_op", name="aten::mm", ts=0, dur=1000, tid=1)]

    class Trace:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump(dict(traceEvents=events), f)

    g = _gpu_profile(Trace(), sm_count=132)
    # NCCL's 70 us less the 20 us under GEMMs, the peer copy's 50, TIDE's kernel's 10.
    assert g["exposed_comm_ms"] == pytest.approx((50 + 50 + 10) / 1e3)
    assert g["comm_sms"] == 132  # TIDE's kernel asked for 200 blocks: at most every SM
    ks = g["comm_kernels"]
    assert ks["ncclDevKernel_ReduceScatter_Sum_f32"] == dict(count=1, sms=16, copy_engine=False)
    assert ks["Memcpy PtoP (Device -> Device)"] == dict(count=1, sms=0, copy_engine=True)
    assert "Memcpy DtoD (Device -> Device)" not in ks  # on the compute stream: not a collective's


def test_uncovered_time_against_a_unit_grid():
    """The exposed-time sweep against counting unit cells, on random overlapping spans."""
    import random

    from tide.bench.step import _uncovered_us

    rng = random.Random(7)
    for _ in range(200):
        spans = [(a, a + rng.randint(1, 15)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 8)))]
        cover = [(a, a + rng.randint(1, 15)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 8)))]
        cells = sum(1 for t in range(80) if any(a <= t < b for a, b in spans)
                    and not any(a <= t < b for a, b in cover))
        assert _uncovered_us(spans, cover) == cells, (spans, cover)


def test_cpu_floor_by_hand():
    """cpu_account on two hosts: medians per rank over its steps, means over ranks, and the
    floor from the host whose ranks' CPU over the union of their cores is the largest."""
    from tide.bench.step import cpu_account

    def rank(host, cpus, steps):
        return dict(host=host, cpus=cpus, cpu_ms=steps)

    ranks = [rank("a", [0], [(10.0, 1.0), (30.0, 3.0), (20.0, 2.0)]),  # medians 20, 2
             rank("a", [1], [(40.0, 0.0), (40.0, 0.0)]),  # 40, 0
             rank("b", [0, 1, 2, 3], [(50.0, 10.0)]),  # 50, 10
             rank("b", [2, 3], [(70.0, 10.0)])]  # 70, 10
    c = cpu_account(ranks)
    assert c["user_ms"] == (20 + 40 + 50 + 70) / 4 and c["system_ms"] == (2 + 0 + 10 + 10) / 4
    # host a: 62 ms over 2 cores = 31; host b: 140 ms over 4 cores = 35
    assert (c["floor_ms"], c["cores"], c["hosts"]) == (35.0, 4, 2)
    ranks[0]["cpu_ms"] = [(60.0, 8.0)]  # host a: 108 / 2 = 54 is now the busiest
    assert (cpu_account(ranks)["floor_ms"], cpu_account(ranks)["cores"]) == (54.0, 2)


def test_a_missing_knob_is_named_once_over_rounds():
    """Every round configures the best variant again: each knob this torch lacks is named once."""
    from tide.bench.step import Variant

    v = Variant("best", True)
    for _ in range(3):
        v.note_missing("zero-CTA NCCL policy", "force-sum reduction")
        v.note_missing("force-sum reduction")
    assert v.missing_knobs == ["zero-CTA NCCL policy", "force-sum reduction"]


_FAILING_BUILD = '''
import sys
from tide.bench import step

build = step._build
def failing(args, variant, groups, device):
    import torch.distributed as dist
    if variant.impl == "tide-slot-reuse" and dist.get_rank() == 1:
        raise RuntimeError("injected by the test")
    return build(args, variant, groups, device)
step._build = failing
sys.exit(step.main())
'''


def test_a_variant_that_fails_to_build_on_one_rank_is_reported_and_the_run_goes_on(tmp_path):
    """A variant whose build raises on one rank only (a knob a torch refuses, memory) is
    reported as failed, naming the rank and its error, on every rank; the other variants are
    measured in every round, and the run ends (the other rank does not hang in the variant's
    first collective)."""
    script = tmp_path / "failing_build.py"
    script.write_text(_FAILING_BUILD)
    out = tmp_path / "step.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--device", "cpu", "--model", "llama3.1-70b", "--layers", "1", "--hidden-divisor", "64",
           "--precision", "fp32", "--variants", "tide", "tide-slot-reuse", "--steps", "1", "--warmup", "1",
           "--rounds", "2", "--profile-steps", "1", "--timeout", "60", "--json", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=slack(180))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())["results"]
    assert res["tide-slot-reuse-fp32"] == {"skipped": "failed to build: rank 1: RuntimeError: injected by the test"}
    assert len(res["tide-fp32"]["step_ms"]["per_step"]) == 2  # one timed step in each of the two rounds
    assert "failed to build: rank 1: RuntimeError: injected by the test" in p.stdout


def _configure_best_worker(rank, world_size):
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from tide.bench import step

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    variant = step.Variant("best", True)
    step._configure_best(model, variant, dist.new_group(backend="gloo"))
    checked = 0
    # Every param group in this process (found without FSDP2's per-version attribute names),
    # through FSDP2's lazy-init check where this torch has it (2.15)
    groups = [o for o in gc.get_objects() if isinstance(o, FSDPParamGroup)]
    for g in groups:
        validate = getattr(g, "_validate_reduce_scatter_max_input_buffers", None)
        if validate is not None:
            validate()  # what FSDP2's lazy init runs at the first forward: raises on a bad mix
            checked += 1
    return dict(missing=variant.missing_knobs, checked=checked, groups=len(groups),
                torch_has_separate_rs=hasattr(FSDPParamGroup, "_set_separate_reduce_scatter_group"))


def test_best_configured_knobs_are_set_as_this_torch_takes_them():
    """The best-configured variant's knobs on FSDP2 modules of the running torch (CPU here; its
    collectives are CUDA's, so only the configuration runs): no knob this torch has is left
    out, none raises (torch 2.11 keeps one param group per FSDP state, 2.15 a list), and the
    mix passes FSDP2's own check at lazy init (2.15 refuses several reduce-scatter input
    buffers beside its symmetric-memory reduce-scatter: named as not combinable instead)."""
    from dist_harness import run_ranks

    out = run_ranks(_configure_best_worker, 2, backend="gloo")
    for r in out:
        assert r["groups"] == 2, r  # the two layers' (the root holds no parameter of its own: no group)
        separate = "a separate reduce-scatter group (FSDPModule.set_separate_reduce_scatter_group)"
        assert (separate in r["missing"]) != r["torch_has_separate_rs"], r
        if r["checked"]:  # a torch with the check (2.15): the symmetric-memory mix is named
            assert any(k.startswith("two reduce-scatter input buffers: this torch refuses them") for k in r["missing"]), r
