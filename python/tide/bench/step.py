"""The paper's experiment: FSDP2 training steps of its workloads, stock FSDP2 against TIDE,
measured side by side in one run, with the step-time model's prediction and the paper's
figures beside them.

    torchrun --nproc-per-node 8 --nnodes 8 ... -m tide.bench.step --model llama3.1-70b \\
        [--layers N] [--hidden-divisor K] [--tokens-per-gpu T] [--steps 20] [--json out.json]

Every variant trains the same model from the same weights on the same batches, one after
the other in the same processes:
- stock FSDP2 on the baseline backend (NCCL on GPUs, gloo on CPUs);
- FSDP2 as its best users configure it (GPUs only): symmetric memory for its collectives
  with force-sum reduction on a zero-CTA NCCL group, a separate reduce-scatter group and two
  reduce-scatter input buffers, each where the running torch has it (the others are named);
- TIDE (the tide backend, FSDP2's collectives replaced by TIDE-AG / TIDE-RS);
- TIDE with Slot-Reuse (TIDE_SLOT_REUSE=1);
- the bound: the same model unsharded on every rank, from the same weights, with AdamW over
  a shard's worth of parameters: the step without any collective or FSDP2 bookkeeping, which
  no variant can beat (where the whole model fits one device).
The model is built on the meta device, sharded, then each rank fills its own shards, so a
70B model fits. Mixed precision: bf16 parameters with fp32 reduction on GPUs (the paper's
setting); on CPUs fp32 and bf16 both, every variant in each. Activation checkpointing per
block unless --no-activation-checkpointing. AdamW fused (torchtitan's default; --optimizer
foreach for the multi-tensor one), the same in every variant and the bound.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

from . import model as step_model
from . import workloads as wl

# The paper's figures (shared/mission/TIDE.md), printed beside the measurements; never used
# in a computation.
PAPER = step_model.PAPER
# Time-to-accuracy does not change: the variants differ in how bytes move, not in the math.
IMPLS = ("stock", "best", "tide", "tide-slot-reuse", "bound")
IMPL_LABEL = {"stock": "stock FSDP2", "best": "FSDP2 best-configured", "tide": "TIDE",
              "tide-slot-reuse": "TIDE + Slot-Reuse", "bound": "bound: no communication"}
# Tokens per GPU: on GPUs the step-time model's (the paper's 8K for the decoders, one
# 81-frame 480x832 clip for the DiT); on CPUs a small batch: a core computes about a
# thousand times slower than an H200, so 8K tokens would bury what the collectives cost.
DEFAULT_TOKENS = {"llama3.1-70b": 8192, "qwen3-30b-a3b": 8192, "wan2.2-14b": 32760, "cpu": 128}
DEFAULT_SEQ = 8192


@dataclass
class Variant:
    impl: str
    bf16: bool
    skipped: str = ""  # why it did not run (printed and in the JSON)
    missing_knobs: list = field(default_factory=list)  # best-configured: what this torch lacks

    @property
    def key(self) -> str:
        return f"{self.impl}-{'bf16' if self.bf16 else 'fp32'}"

    def note_missing(self, *knobs: str) -> None:  # every round configures it: each knob once
        for k in knobs:
            if k not in self.missing_knobs:
                self.missing_knobs.append(k)

    def label(self, baseline: str) -> str:
        engine = f" / {baseline}" if self.impl in ("stock", "best") else ""
        return f"{IMPL_LABEL[self.impl]}{engine} {'bf16' if self.bf16 else 'fp32'}"


# --------------------------------------------------------------------------------------
# one variant on this rank
# --------------------------------------------------------------------------------------

def _process_groups(device_type: str, timeout: timedelta):
    """The groups the variants run on: stock's baseline group, the tide group (the default
    group, as users create it) and a gloo group of this script's own bookkeeping; every one
    with the run's timeout (torch's default for a new group is 10 or 30 minutes)."""
    import torch.distributed as dist

    baseline = "nccl" if device_type == "cuda" else "gloo"
    return dict(tide=dist.group.WORLD, baseline=dist.new_group(backend=baseline, timeout=timeout),
                meta=dist.new_group(backend="gloo", timeout=timeout), baseline_name=baseline, timeout=timeout)


def _best_groups(timeout: timedelta) -> dict:
    """The best-configured variant's NCCL groups: FSDP2's (zero-CTA, so symmetric-memory
    all-gathers go to the copy engines, where the torch has the policy) and its separate
    reduce-scatter group (default options). Both NCCL: FSDP2's own
    set_separate_reduce_scatter_group would create the default backend's, here tide."""
    import torch.distributed as dist

    nccl, missing = dist.ProcessGroupNCCL, []
    if hasattr(nccl, "NCCL_CTA_POLICY_ZERO"):
        opts = nccl.Options()
        opts.config.cta_policy = nccl.NCCL_CTA_POLICY_ZERO
        fsdp = dist.new_group(backend="nccl", pg_options=opts, timeout=timeout)
    else:
        missing.append("zero-CTA NCCL policy (ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO)")
        fsdp = dist.new_group(backend="nccl", timeout=timeout)
    return dict(best=fsdp, best_rs=dist.new_group(backend="nccl", timeout=timeout), best_missing=missing)


def _configure_best(model, variant: Variant, rs_group):
    """FSDP2's own knobs, each where this torch has it, in the order they depend on each
    other: the separate reduce-scatter group and force-sum first (symmetric memory takes
    the reduce-scatter only with force-sum on, on the group it sees then), symmetric memory,
    then the reduce-scatter input buffers. Several knobs act on one module's groups only:
    every FSDP module gets them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def each(method, *args):
        for m in modules:
            getattr(m, method)(*args)

    def param_groups(m):  # torch 2.15: a list per module; 2.11-2.14: at most one
        state = m._get_fsdp_state()
        if hasattr(state, "_fsdp_param_groups"):
            return list(state._fsdp_param_groups)
        return [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]

    groups = [g for m in modules for g in param_groups(m)]
    if groups and hasattr(groups[0], "_set_separate_reduce_scatter_group"):
        ranks = tuple(dist.get_process_group_ranks(rs_group))
        for g in groups:  # FSDP2's own method, given our NCCL group for these ranks
            g._set_separate_reduce_scatter_group(True, {ranks: rs_group})
    else:
        variant.note_missing("a separate reduce-scatter group (FSDPModule.set_separate_reduce_scatter_group)")
    if hasattr(model, "set_force_sum_reduction_for_comms"):
        each("set_force_sum_reduction_for_comms", True)
    else:
        variant.note_missing("force-sum reduction (FSDPModule.set_force_sum_reduction_for_comms)")
    if hasattr(model, "set_symm_mem_for_comm"):
        each("set_symm_mem_for_comm")
    elif hasattr(model, "set_allocate_memory_from_process_group_for_comm"):
        variant.note_missing("symmetric memory (FSDPModule.set_symm_mem_for_comm): NCCL's allocator "
                             "for the staging buffers instead")
        each("set_allocate_memory_from_process_group_for_comm", True)
    else:
        variant.note_missing("symmetric memory (FSDPModule.set_symm_mem_for_comm)")
    symm_rs = any(type(getattr(g, "_reduce_scatter_comm", None)).__name__ == "SymmMemReduceScatter" for g in groups)
    if symm_rs and hasattr(model, "set_reduce_scatter_max_input_buffers"):
        # torch refuses more than one input buffer beside the symmetric-memory reduce-scatter
        # (its pool reuses one buffer): FSDP2 raises at the first forward.
        variant.note_missing("two reduce-scatter input buffers: this torch refuses them with the "
                             "symmetric-memory reduce-scatter (kept at one)")
    elif hasattr(model, "set_reduce_scatter_max_input_buffers"):
        model.set_reduce_scatter_max_input_buffers(2)  # recurses
    else:
        variant.note_missing("two reduce-scatter input buffers (FSDPModule.set_reduce_scatter_max_input_buffers)")


def _module(args):
    """The model on the meta device, each block checkpointed unless told otherwise."""
    import torch

    from . import nets

    shape = wl.scaled(wl.SHAPES[args.model], args.layers, args.hidden_divisor)
    with torch.device("meta"):
        model = nets.BUILDERS[args.model](shape)
    if args.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    return model


def _build(args, variant: Variant, groups, device):
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from . import nets

    model = _module(args)
    group = {"stock": groups["baseline"], "best": groups.get("best"), "tide": groups["tide"],
             "tide-slot-reuse": groups["tide"]}[variant.impl]
    mesh = DeviceMesh.from_group(group, device.type)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if variant.bf16 else MixedPrecisionPolicy())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if variant.impl == "best":
        _configure_best(model, variant, groups["best_rs"])
    model.to_empty(device=device)
    nets.init_weights(model, group.rank(), seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{args.optimizer: True})
    return model, opt


def _build_bound(args, variant: Variant, groups, device):
    """The bound's model: unsharded on every rank, with the weights every variant starts
    from (stock's, gathered once, untimed), in the variant's compute dtype; and its optimizer."""
    import torch

    sharded, _ = _build(args, Variant("stock", variant.bf16), groups, device)
    full = {name: p.full_tensor() for name, p in sharded.named_parameters()}
    del sharded
    model = _module(args)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full.pop(name))
    if variant.bf16:
        model.to(torch.bfloat16)  # what the bf16 policy computes in (gradients bf16 too)
    return model, _ShardOptimizer(model, groups["baseline"].size(), device, args.optimizer)


class _ShardOptimizer:
    """The bound's optimizer: AdamW, as the variants', over fp32 tensors of this rank's shard
    sizes (FSDP2's padded dim-0 chunks) whose gradients are drawn once, so its step does a
    sharded step's optimizer work with no reduce-scatter to produce the gradients; zero_grad
    drops the unsharded model's gradients, as the variants' drop theirs."""

    def __init__(self, model, world_size: int, device, implementation: str):
        import torch

        self.model = model
        shards = []
        for p in model.parameters():
            rows = -(-p.shape[0] // world_size)
            t = (torch.randn(rows * (p.numel() // p.shape[0]), device=device) * 0.02).requires_grad_()
            t.grad = torch.randn_like(t) * 1e-3
            shards.append(t)
        self.adamw = torch.optim.AdamW(shards, lr=1e-4, **{implementation: True})

    def step(self):
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True):
        self.model.zero_grad(set_to_none=set_to_none)


def bound_fits(args, device) -> str:
    """Why the bound cannot run on this device ("" where it can): on GPUs the whole model in
    fp32 (gathered) and its parameters and gradients in bf16 must fit half the device."""
    import torch

    if device.type != "cuda":
        return ""
    numel = wl.WORKLOADS[args.model](shape=wl.scaled(wl.SHAPES[args.model], args.layers, args.hidden_divisor)).numel
    need, have = numel * (4 + 2 * 2), torch.cuda.get_device_properties(device).total_memory / 2
    return ("" if need <= have else f"the model unsharded ({_fmt_bytes(need)} with its gradients) does not fit "
            f"half of one device ({_fmt_bytes(have)}): --layers / --hidden-divisor shrink it")


def _reset_peak(device):
    import torch

    from tide import demo

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    # The variants run one after another in one process: what an earlier one freed goes
    # back to the system first, or this one would reuse it without growing the resident set.
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    demo._peak_rss_reset()  # VmHWM back to the current resident set
    return demo._rss_kib("VmRSS") * 1024


def _peak_bytes(device, base: int) -> int:
    """The allocator's peak on GPU; on CPU the growth of the peak resident set over `base`
    (the resident set when the variant started, so earlier variants do not count)."""
    import torch

    from tide import demo

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return demo._rss_kib("VmHWM") * 1024 - base


def _device_used(device) -> int:
    """GPU memory in use on the device (cudaMemGetInfo): unlike the allocator's figures it
    counts TIDE's symmetric memory (cuMemCreate / cudaMalloc) and NCCL's buffers too."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _gpu_profile(prof, sm_count: int) -> dict:
    """From a profiled step's trace: the collectives' kernels (NCCL's and TIDE's, by name)
    and copy-engine transfers (device copies off the compute stream: TIDE-AG's, symmetric
    memory's), the SMs their kernels asked for (grid blocks, at most the GPU's SMs), and the
    exposed communication: the time communication runs while no other kernel does."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as t:
            events = [ev for ev in json.load(t).get("traceEvents", [])
                      if ev.get("cat") in ("kernel", "gpu_memcpy") and "dur" in ev]

    def named_comm(ev):
        name = ev.get("name", "").lower()
        return "nccl" in name or "tide" in name

    kernel_us: dict = {}  # the compute stream: most time in kernels that are not collectives'
    for ev in events:
        if ev["cat"] == "kernel" and not named_comm(ev):
            kernel_us[ev.get("tid")] = kernel_us.get(ev.get("tid"), 0.0) + float(ev["dur"])
    compute_stream = max(kernel_us, key=kernel_us.get) if kernel_us else None
    comm, compute, kernels = [], [], {}
    for ev in events:
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        copy = ev["cat"] == "gpu_memcpy"
        is_comm = (copy and ev.get("tid") != compute_stream) or named_comm(ev)
        (comm if is_comm else compute).append(span)
        if is_comm:
            blocks = 1
            for g in ev.get("args", {}).get("grid", [0]):
                blocks *= int(g)
            k = kernels.setdefault(ev.get("name", "")[:60], dict(count=0, sms=0, copy_engine=copy))
            k["count"] += 1
            k["sms"] = max(k["sms"], 0 if copy else min(blocks, sm_count))
    return dict(exposed_comm_ms=_uncovered_us(comm, compute) / 1e3, comm_kernels=kernels,
                comm_sms=max((k["sms"] for k in kernels.values()), default=0))


def _union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _uncovered_us(spans, cover) -> float:
    """The time in the union of `spans` that the union of `cover` leaves free (one sweep)."""
    free, covered, j = 0.0, _union(cover), 0
    for a, b in _union(spans):
        while j < len(covered) and covered[j][1] <= a:
            j += 1
        t, k = a, j
        while k < len(covered) and covered[k][0] < b:
            free += max(0.0, covered[k][0] - t)
            t = max(t, covered[k][1])
            k += 1
        free += max(0.0, b - t)
    return free


class VariantFailed(Exception):
    """A variant that could not be built on some rank (a knob this torch refuses, memory): every
    rank raises it, naming each rank's error, so the run reports it and goes on."""


def _agreed(groups, build):
    """build() on every rank, then the ranks compare outcomes over the bookkeeping group before
    any collective of the variant: if one rank failed, every rank raises VariantFailed (a rank
    that went on alone would hang in the variant's first collective)."""
    import torch.distributed as dist

    error, built = "", None
    try:
        built = build()
    except Exception as e:  # noqa: BLE001  reported, with its rank, on every rank
        error = f"rank {dist.get_rank()}: {type(e).__name__}: {str(e)[:300]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=groups["meta"])
    errors = [e for e in errors if e]
    if errors:
        raise VariantFailed("; ".join(errors))
    return built


def run_variant(args, variant: Variant, groups, device) -> dict:
    """Trains `variant` for warm-up + timed + profiled steps; this rank's measurements."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import tide.fsdp
    from tide import demo

    old_reuse = os.environ.get("TIDE_SLOT_REUSE")
    os.environ["TIDE_SLOT_REUSE"] = "1" if variant.impl == "tide-slot-reuse" else "0"
    stats_before = dict(tide.fsdp.stats)
    try:
        if variant.impl == "best":
            if "best" not in groups:  # once, for every round and precision
                groups.update(_best_groups(groups["timeout"]))
            variant.note_missing(*groups["best_missing"])
        base = _reset_peak(device)
        used_before = _device_used(device) if device.type == "cuda" else 0
        used_growth = 0
        build = _build_bound if variant.impl == "bound" else _build
        model, opt = _agreed(groups, lambda: build(args, variant, groups, device))
        rank = dist.get_rank()
        tokens, seq = args.tokens_per_gpu, min(args.seq_len, args.tokens_per_gpu)

        def step(i):
            loss = model.loss(model.batch(tokens, seq, i, rank, device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        step_ms, losses, cpu_ms = [], [], []
        for i in range(args.warmup + args.steps):
            dist.barrier(group=groups["meta"])  # every rank starts the step together
            # The process's CPU, every thread's (gloo's, the backend's worker, the kernel's
            # work in their system calls): on CPUs the cores it leaves idle bound the step.
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            loss = step(i)
            sync()
            elapsed = (time.perf_counter() - t0) * 1e3
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            losses.append(loss.item())
            if i >= args.warmup:
                step_ms.append(elapsed)
                cpu_ms.append(((u1.ru_utime - u0.ru_utime) * 1e3, (u1.ru_stime - u0.ru_stime) * 1e3))
            if device.type == "cuda":
                used_growth = max(used_growth, _device_used(device) - used_before)
        peak = _peak_bytes(device, base)
        records, gpu = [], []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        profiled_ms = []
        for i in range(args.profile_steps):
            dist.barrier(group=groups["meta"])
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                step(args.warmup + args.steps + i)
                sync()
                profiled_ms.append((time.perf_counter() - t0) * 1e3)
            records.append(demo.step_record(prof.events(), prof.profiler.kineto_results.trace_start_ns()))
            if device.type == "cuda":
                copies = sum(ev.device_time_total for ev in prof.events() if demo._base(ev.name) in demo.COPY_OPS)
                g = _gpu_profile(prof, torch.cuda.get_device_properties(device).multi_processor_count)
                g["layout_copies_ms"] = copies / 1e3
                gpu.append(g)
        paths = {k: tide.fsdp.stats[k] - stats_before[k] for k in tide.fsdp.stats}
        model = opt = None  # freed before the next variant builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            tide.fsdp.release_cuda_pools()
            torch.cuda.empty_cache()
        return dict(step_ms=step_ms, cpu_ms=cpu_ms, host=platform.node(), cpus=sorted(os.sched_getaffinity(0)),
                    losses=losses, peak_bytes=peak, device_used_growth=used_growth, records=records,
                    profiled_ms=profiled_ms, gpu=gpu, paths=paths)
    finally:
        if old_reuse is None:
            os.environ.pop("TIDE_SLOT_REUSE", None)
        else:
            os.environ["TIDE_SLOT_REUSE"] = old_reuse


# --------------------------------------------------------------------------------------
# every rank's measurements -> one variant's figures
# --------------------------------------------------------------------------------------

def merge_rounds(rounds: list[dict]) -> dict:
    """One rank's measurements of a variant over its rounds: every round's timed steps, the
    first round's losses (each round trains from the same weights on the same batches; every
    round's kept, to show they agree), the last round's profiled steps, the highest peak, the
    FSDP2 paths taken in all, every round's CPU per step."""
    first = rounds[0]
    return dict(step_ms=[ms for r in rounds for ms in r["step_ms"]], cpu_ms=[c for r in rounds for c in r["cpu_ms"]],
                host=first["host"], cpus=first["cpus"], losses=first["losses"],
                round_losses=[r["losses"] for r in rounds],
                peak_bytes=max(r["peak_bytes"] for r in rounds),
                device_used_growth=max(r["device_used_growth"] for r in rounds),
                records=[x for r in rounds for x in r["records"]],
                profiled_ms=[x for r in rounds for x in r["profiled_ms"]],
                gpu=[x for r in rounds for x in r["gpu"]],
                paths={k: sum(r["paths"][k] for r in rounds) for k in first["paths"]})


def summarize(ranks: list[dict], tokens_per_gpu: int) -> dict:
    """Step time of the slowest rank per step (median, min, max over the timed steps),
    tokens/s of the whole group, the profiled steps' breakdown (mean over ranks and steps),
    peak memory (the largest rank's), losses (mean over ranks, per step; and per round); on
    CPUs, the CPU the ranks used per step and the floor it sets (cpu_account)."""
    from tide import demo

    def mean_losses(of_rank):
        return [statistics.fmean(of_rank(r)[i] for r in ranks) for i in range(len(of_rank(ranks[0])))]

    ws = len(ranks)
    slowest = [max(r["step_ms"][i] for r in ranks) for i in range(len(ranks[0]["step_ms"]))]
    median = statistics.median(slowest)
    parts = [demo.breakdown([r["profiled_ms"][s] for r in ranks], [r["records"][s] for r in ranks])
             for s in range(len(ranks[0]["records"]))]
    mean = {k: statistics.fmean(p[k] for p in parts) for k in ("step",) + demo.PARTS} if parts else {}
    out = dict(step_ms=dict(median=median, min=min(slowest), max=max(slowest), per_step=slowest),
               tokens_per_s=tokens_per_gpu * ws / (median / 1e3),
               breakdown=mean,
               peak_bytes=max(r["peak_bytes"] for r in ranks),
               device_used_growth=max(r["device_used_growth"] for r in ranks),
               losses=mean_losses(lambda r: r["losses"]),
               round_losses=[mean_losses(lambda r, k=k: r["round_losses"][k]) for k in range(len(ranks[0]["round_losses"]))],
               paths=ranks[0]["paths"])
    if not ranks[0]["gpu"] and ranks[0]["cpu_ms"]:
        out["cpu"] = cpu_account(ranks)
    if ranks[0]["gpu"]:
        out["gpu"] = dict(
            exposed_comm_ms=statistics.fmean(g["exposed_comm_ms"] for r in ranks for g in r["gpu"]),
            layout_copies_ms=statistics.fmean(g["layout_copies_ms"] for r in ranks for g in r["gpu"]),
            comm_sms=max(g["comm_sms"] for r in ranks for g in r["gpu"]),
            comm_kernels=ranks[0]["gpu"][-1]["comm_kernels"])
    return out


def cpu_account(ranks: list[dict]) -> dict:
    """CPU per timed step (user and system time of every thread of a rank's process, the
    median over its steps, the mean over ranks) and the floor it sets on the step: on each
    host, its ranks' CPU per step over the cores they may run on (the union of their
    affinities); the step is at least the largest, and idle cores make up the rest."""
    # (user, system) medians of each rank, in the order of ranks
    medians = [tuple(statistics.median(c[i] for c in r["cpu_ms"]) for i in (0, 1)) for r in ranks]
    used: dict = {}
    cpus: dict = {}
    for r, (user, system) in zip(ranks, medians):
        used[r["host"]] = used.get(r["host"], 0.0) + user + system
        cpus.setdefault(r["host"], set()).update(r["cpus"])
    busiest = max(used, key=lambda h: used[h] / len(cpus[h]))
    return dict(user_ms=statistics.fmean(m[0] for m in medians),
                system_ms=statistics.fmean(m[1] for m in medians),
                floor_ms=used[busiest] / len(cpus[busiest]), cores=len(cpus[busiest]), hosts=len(used))


def exposed_comm_ms(res: dict) -> float:
    """GPU: communication no kernel overlaps (from the trace); CPU: time in FSDP2's
    collective seams less their layout copies and the wait for a slower peer."""
    if "gpu" in res:
        return res["gpu"]["exposed_comm_ms"]
    return res["breakdown"].get("exposed communication", float("nan"))


def layout_copies_ms(res: dict) -> float:
    if "gpu" in res:
        return res["gpu"]["layout_copies_ms"]
    return res["breakdown"].get("layout copies", float("nan"))


def prediction(args, world_size: int, local_size: int, device_name: str) -> dict:
    """The step-time model for the same (scaled) workload, batch and cluster: the hardware
    preset of this GPU (H100 or H200; the H200 preset elsewhere, named), its world size and
    GPUs per node, calibrated where --calibrate measured."""
    name = device_name.lower()
    preset = "h100-sxm" if "h100" in name else "h200-measured"
    hw = step_model.hwmod.PRESETS[preset]
    if args.calibration:
        hw, _ = step_model.hwmod.calibrate(hw, args.calibration)
    hw = hw.replace(gpus_per_node=local_size, nics_per_node=local_size)
    shape = wl.scaled(wl.SHAPES[args.model], args.layers, args.hidden_divisor)
    seq = min(args.seq_len, args.tokens_per_gpu)
    workload = (wl.WORKLOADS[args.model](args.tokens_per_gpu, shape=shape) if args.model == "wan2.2-14b"
                else wl.WORKLOADS[args.model](args.tokens_per_gpu, seq, shape=shape))
    res = step_model.run_workload(workload, hw, step_model.Options(world_size=world_size))
    return dict(hardware=hw.name, world_size=world_size, gpus_per_node=local_size,
                params=workload.numel, step_ms={k: 1e3 * v for k, v in res["step_s"].items()},
                tide_vs_stock_pct=res["tide_vs_stock_pct"], tide_vs_symm_pct=res["tide_vs_symm_pct"],
                peak_GiB=res["peak_GiB"], peak_GiB_tide_slot_reuse=res["peak_GiB_tide_slot_reuse"])


def measure_calibration(device, baseline_group, timeout: timedelta) -> dict:
    """What this GPU measures of the model's constants: a large bf16 GEMM's rate, a
    device-to-device copy's bytes read + written per second, the SMs, the GPUs per node, and
    NCCL's all-gather bus bandwidth inside a node (over each node's GPUs)."""
    import torch
    import torch.distributed as dist

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm_s = timed(lambda: a @ a)
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    out = dict(device=torch.cuda.get_device_name(device), gemm_bf16_TFLOPs=2 * n**3 / gemm_s / 1e12,
               hbm_copy_GBps=2 * src.numel() / copy_s / 1e9,
               sm_count=torch.cuda.get_device_properties(device).multi_processor_count,
               gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    local = out["gpus_per_node"]
    if local > 1 and dist.get_world_size(baseline_group) % local == 0:
        # Within each node: the group itself on one node, else one NCCL group per node.
        node = (baseline_group if dist.get_world_size(baseline_group) == local
                else dist.new_subgroups(local, backend="nccl", timeout=timeout)[0])
        shard = torch.empty(1 << 26, dtype=torch.bfloat16, device=device)
        full = torch.empty(shard.numel() * local, dtype=torch.bfloat16, device=device)
        ag_s = timed(lambda: dist.all_gather_into_tensor(full, shard, group=node), reps=5)
        out["nvlink_GBps"] = full.numel() * 2 * (local - 1) / local / ag_s / 1e9
    return out


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------

def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def format_report(report: dict) -> str:
    run, results = report["run"], report["results"]
    lines = [f"tide.bench.step: {run['workload']}, {run['params'] / 1e6:.1f}M parameters, "
             f"{run['world_size']} ranks ({run['nodes']} node{'s' if run['nodes'] > 1 else ''} x "
             f"{run['local_size']}), {run['device']}, torch {run['torch']}"
             + (f", NCCL {run['nccl']}" if run.get("nccl") else ""),
             f"  {run['tokens_per_gpu']} tokens per rank ("
             + ("one clip: every token attends to all of them" if run["workload"].startswith("wan")
                else f"sequences of {run['seq_len']}") + "), "
             f"activation checkpointing {'on' if run['activation_checkpointing'] else 'off'}, "
             f"AdamW ({run['optimizer']}), {run['warmup']} warm-up + {run['steps']} timed steps per variant"
             + (f" in each of {run['rounds']} rounds (the variants take turns)" if run.get("rounds", 1) > 1 else "")
             + f", then {run['profile_steps']} profiled",
             f"  {run['machine']}", ""]
    head = (f"{'variant':<34}{'step ms median [min-max]':>27}{'tokens/s':>11}{'exposed comm':>14}"
            f"{'layout copies':>15}{'peak mem':>10}  vs stock (same precision)")
    lines.append(head)
    for key, res in results.items():
        label = report["labels"][key]
        if "skipped" in res:
            lines.append(f"{label:<34}  not run: {res['skipped']}")
            continue
        st = res["step_ms"]
        stock = results.get(f"stock-{key.rsplit('-', 1)[1]}")
        ratio = (f"{st['median'] / stock['step_ms']['median']:.2f}x"
                 if stock and "step_ms" in stock and not key.startswith("stock") else "")
        lines.append(f"{label:<34}{st['median']:>10.1f} [{st['min']:.1f}-{st['max']:.1f}]".ljust(61)
                     + f"{res['tokens_per_s']:>11.0f}{exposed_comm_ms(res):>11.1f} ms"
                     f"{layout_copies_ms(res):>12.1f} ms{_fmt_bytes(res['peak_bytes']):>10}  {ratio}")
    lines.append("")
    lines.append("step: the slowest rank's, per timed step; exposed comm and layout copies (ms per step)"
                 " from the profiled steps, mean over ranks; peak memory: "
                 + ("the CUDA allocator's peak, largest rank (it does not see TIDE's symmetric memory)"
                    if run["device"].startswith("cuda")
                    else "growth of the peak resident set over the variant, largest rank"))
    if any(k.startswith("bound") for k in results):
        lines.append("bound: the model unsharded on every rank from the same weights, forward + backward + AdamW "
                     "over a shard's worth of fp32 parameters; no collective, no FSDP2: the floor of every variant")
    cpu_rows = [(k, r) for k, r in results.items() if "cpu" in r]
    if cpu_rows:
        c0 = cpu_rows[0][1]["cpu"]
        lines.append(f"CPU per step, every thread of a rank (median over steps, mean over ranks), and the floor it "
                     f"sets: the ranks' CPU over the {c0['cores']} cores of "
                     + ("their host" if c0["hosts"] == 1 else "the busiest host") + " (the step's idle cores are the rest):")
        for key, res in cpu_rows:
            c = res["cpu"]
            lines.append(f"  {report['labels'][key]:<32} user {c['user_ms']:6.1f} ms  system {c['system_ms']:5.1f} ms  "
                         f"floor {c['floor_ms']:6.1f} ms  (step {res['step_ms']['median']:.1f})")
    gpu_rows = [(k, r) for k, r in results.items() if "gpu" in r]
    if gpu_rows:
        lines.append("device memory in use, growth over the variant at step ends (cudaMemGetInfo: TIDE's "
                     "symmetric memory and NCCL's buffers included), largest rank: "
                     + ", ".join(f"{report['labels'][k]} {_fmt_bytes(r['device_used_growth'])}" for k, r in gpu_rows))
        lines.append("collectives' kernels (profiler; SMs = grid blocks, at most the GPU's):")
        for key, res in gpu_rows:
            ks = ", ".join(f"{n} x{k['count']} ({'copy engine' if k['copy_engine'] else str(k['sms']) + ' SMs'})"
                           for n, k in list(res["gpu"]["comm_kernels"].items())[:4]) or "none"
            lines.append(f"  {report['labels'][key]}: {ks}")
    else:
        lines.append("collectives' kernels and SMs: none on CPU (the collectives run on the ranks' threads)")
    for key, res in results.items():
        if res.get("missing_knobs"):
            lines.append(f"{report['labels'][key]}: this torch lacks " + "; ".join(res["missing_knobs"]))
    pred = report.get("prediction")
    if pred:
        s = pred["step_ms"]
        lines.append("")
        lines.append(f"step-time model ({pred['hardware']}, {pred['world_size']} GPUs, {pred['gpus_per_node']} per "
                     f"node, this workload and batch): stock {s['stock']:.3g} ms, FSDP2+SymmMem {s['symm']:.3g} ms, "
                     f"TIDE {s['tide']:.3g} ms ({pred['tide_vs_stock_pct']:+.1f}% vs stock, "
                     f"{pred['tide_vs_symm_pct']:+.1f}% vs SymmMem)"
                     + ("" if run["device"].startswith("cuda") else
                        "; a model of NVIDIA GPUs, not of this CPU: for scale only"))
    lines.append(f"the paper (64 GPUs, bf16): step up to {PAPER['step_vs_stock_pct']}% vs stock FSDP2, up to "
                 f"{PAPER['step_vs_symm_pct']}% vs FSDP2+SymmMem; layout copies {PAPER['layout_share_pct']}% of "
                 f"stock's step (Llama-3.1 70B, 8K tokens/GPU)")
    return "\n".join(lines)


def write_png(report: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [(k, r) for k, r in report["results"].items() if "step_ms" in r]
    labels = [report["labels"][k] for k, _ in ran]
    parts = ("compute", "exposed communication", "waiting for a slower peer", "layout copies", "optimizer")
    colors = ("#9aa5b1", "#2b6cb0", "#a3bffa", "#e53e3e", "#68d391")
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw=dict(width_ratios=[3, 1.3]))
    def part_ms(r, part):
        if "gpu" not in r:
            return r["breakdown"].get(part, 0.0)
        # GPU: FSDP2's ranges time the launches, not the kernels: the trace's figures, the
        # rest of the profiled step as compute
        g = r["gpu"]
        rest = max(0.0, r["breakdown"].get("step", 0.0) - g["exposed_comm_ms"] - g["layout_copies_ms"])
        return {"compute": rest, "exposed communication": g["exposed_comm_ms"],
                "layout copies": g["layout_copies_ms"]}.get(part, 0.0)

    bottom = [0.0] * len(ran)
    for part, color in zip(parts, colors):
        values = [part_ms(r, part) for _, r in ran]
        ax.bar(labels, values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(labels, [r["step_ms"]["median"] for _, r in ran], color="black", zorder=3,
               label="median step (timed steps, slowest rank)")
    ax.set_ylabel("ms per step")
    ax.set_title("where a profiled step's time goes (mean over ranks)")
    ax.legend(fontsize=7)
    mem.bar(labels, [r["peak_bytes"] / 2**20 for _, r in ran], color="#805ad5")
    mem.set_ylabel("MiB")
    mem.set_title("peak memory (CUDA allocator: TIDE's\nsymmetric memory not in it)" if report["run"]["device"].startswith("cuda")
                  else "peak memory (resident set growth)", fontsize=9)
    for a, angle in ((ax, 20), (mem, 50)):  # the narrow panel's labels need the steeper slant
        a.tick_params(axis="x", labelsize=7, labelrotation=angle)
        for t in a.get_xticklabels():
            t.set_horizontalalignment("right")
            t.set_rotation_mode("anchor")
    run = report["run"]
    fig.suptitle(f"{run['workload']}, {run['world_size']} ranks on {run['device']}, torch {run['torch']}",
                 fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="torchrun ... -m tide.bench.step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.1-70b", choices=sorted(wl.WORKLOADS))
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the model's)")
    ap.add_argument("--hidden-divisor", type=int, default=1,
                    help="divides the widths (hidden, FFN, vocabulary, experts' FFN, text); keeps the head dimension")
    ap.add_argument("--tokens-per-gpu", type=int, default=None,
                    help=f"default on GPUs the step-time model's (8192; 32760 for the DiT), "
                         f"{DEFAULT_TOKENS['cpu']} on CPUs")
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ, help="sequence length (at most tokens per GPU)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=None,
                    help="the variants take turns this many times, each built afresh (a machine whose speed "
                         "drifts then slows them alike); default 3 on CPUs, 1 on GPUs")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=1, help="profiled steps per variant, after the timed ones")
    ap.add_argument("--variants", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=None,
                    help="default: bf16 on GPUs (bf16 parameters, fp32 reduction); fp32 and bf16 on CPUs")
    ap.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    ap.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                    help="AdamW's implementation, every variant's and the bound's (default: fused, "
                         "torchtitan's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write every measurement, the machine, torch, NCCL and flags")
    ap.add_argument("--png", metavar="PATH", help="write the figure")
    ap.add_argument("--calibrate", metavar="PATH",
                    help="GPUs: measure the model's constants here, write them to PATH and predict with them")
    ap.add_argument("--timeout", type=float, default=1800, help="process group timeout (s)")
    ap.add_argument("--cpu-threads", type=int, default=1, help="CPU: torch's threads per rank")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: CUDA where torch sees a GPU, else CPU")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no USDT line at each profiler start/stop
    import warnings

    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401  registers the backend and fits TIDE into FSDP2

    if "RANK" not in os.environ:
        print("tide.bench.step runs under torchrun: torchrun --standalone --nproc-per-node 2 -m tide.bench.step",
              file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nccl_here = sorted({"stock", "best", "bound"} & set(args.variants)) + (["--calibrate"] if args.calibrate else [])
    if cuda and torch.cuda.device_count() < ranks_here and nccl_here:
        print(f"tide.bench.step: {ranks_here} ranks on this node share {torch.cuda.device_count()} GPU(s): "
              f"NCCL refuses two ranks on one GPU, so {', '.join(nccl_here)} cannot run (they use NCCL; "
              "--variants tide tide-slot-reuse runs TIDE alone; --device cpu runs on CPUs)", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.cpu_threads)
    if args.rounds is None:
        args.rounds = 1 if cuda else 3
    if args.rounds < 1:
        print("tide.bench.step: --rounds must be at least 1", file=sys.stderr)
        return 2
    if args.tokens_per_gpu is None:
        args.tokens_per_gpu = DEFAULT_TOKENS[args.model if cuda else "cpu"]
    args.precision = args.precision or (["bf16"] if cuda else ["fp32", "bf16"])
    if args.calibrate and not cuda:
        print("tide.bench.step --calibrate: the step-time model is of NVIDIA GPUs; there is none here",
              file=sys.stderr)
        return 2
    dist.init_process_group("tide", timeout=timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("TIDE_LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(ws))))
    groups = _process_groups(device.type, timedelta(seconds=args.timeout))
    args.calibration = None
    if args.calibrate:
        args.calibration = measure_calibration(device, groups["baseline"], groups["timeout"])
        if rank == 0:
            with open(args.calibrate, "w") as f:
                json.dump(args.calibration, f, indent=1)
    from tide.machine import describe, line

    machine = line(describe()) if rank == 0 else ""
    variants = [Variant(impl, p == "bf16") for p in args.precision for impl in args.variants]
    # One untimed step of the first variant first: what a process sets up once (the
    # profiler, gloo's buffers, oneDNN's kernels, CUDA's context) is not the first variant's.
    first = next((v for v in variants if v.impl != "best"), None)
    if first is not None:
        try:
            run_variant(argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 0, "profile_steps": 1}),
                        Variant(first.impl, first.bf16), groups, device)
        except VariantFailed:
            pass  # the variant fails again in its turn, and is reported there
    results, labels, runnable = {}, {}, []
    for v in variants:
        labels[v.key] = v.label(groups["baseline_name"])
        if v.impl == "best" and not cuda:
            v.skipped = ("its knobs (symmetric memory, zero-CTA NCCL, a separate reduce-scatter group, "
                         "several reduce-scatter buffers) are for CUDA devices")
        elif v.impl == "bound":
            v.skipped = bound_fits(args, device)
        if v.skipped:
            results[v.key] = dict(skipped=v.skipped)
        else:
            results[v.key] = None  # keeps the report in the variants' order
            runnable.append(v)
    # Rounds: the variants take turns (a b c a b c ...), each turn built afresh with its own
    # warm-up, so that a machine whose speed drifts over the run (a shared VM) slows every
    # variant alike; the last round also profiles.
    per_round = {v.key: [] for v in runnable}
    for r in range(args.rounds):
        last = r == args.rounds - 1
        for v in runnable:
            if rank == 0:
                print(f"running {labels[v.key]}"
                      + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else "") + " ...", flush=True)
            a = args if last else argparse.Namespace(**{**vars(args), "profile_steps": 0})
            try:
                per_round[v.key].append(run_variant(a, v, groups, device))
            except VariantFailed as e:
                v.skipped = f"failed to build: {e}"
                results[v.key] = dict(skipped=v.skipped)
                if rank == 0:
                    print(f"{labels[v.key]}: {v.skipped}", flush=True)
        runnable = [v for v in runnable if not v.skipped]
    for v in runnable:
        every = [None] * ws
        dist.all_gather_object(every, merge_rounds(per_round[v.key]), group=groups["meta"])
        if rank == 0:
            results[v.key] = summarize(every, args.tokens_per_gpu)
            if v.missing_knobs:
                results[v.key]["missing_knobs"] = v.missing_knobs
    if rank == 0:
        shape = wl.scaled(wl.SHAPES[args.model], args.layers, args.hidden_divisor)
        name = wl.WORKLOADS[args.model](shape=shape).name
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else ""
        report = dict(
            run=dict(workload=name, shape=shape, params=wl.WORKLOADS[args.model](shape=shape).numel,
                     world_size=ws, local_size=local, nodes=ws // local,
                     device=f"cuda ({torch.cuda.get_device_name(device)})" if cuda else "cpu",
                     torch=torch.__version__, nccl=nccl, machine=machine, host=platform.node(),
                     tokens_per_gpu=args.tokens_per_gpu, seq_len=min(args.seq_len, args.tokens_per_gpu),
                     activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer,
                     warmup=args.warmup,
                     steps=args.steps, rounds=args.rounds, profile_steps=args.profile_steps,
                     precision=args.precision,
                     argv=sys.argv[1:] if argv is None else list(argv),
                     tide_env={k: v for k, v in os.environ.items() if k.startswith(("TIDE_", "NCCL_"))}),
            labels=labels, results=results, paper=PAPER,
            prediction=prediction(args, ws, local, torch.cuda.get_device_name(device) if cuda else ""),
            calibration=args.calibration)
        print(format_report(report), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
            print(f"json: {os.path.abspath(args.json)}")
        if args.png:
            write_png(report, args.png)
            print(f"png: {os.path.abspath(args.png)}")
    dist.barrier(group=groups["meta"])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
