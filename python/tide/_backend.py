"""Registers ProcessGroupTide with torch.distributed as the "tide" backend."""
from __future__ import annotations

import os

import torch.distributed as dist

from . import _C

BACKEND_NAME = "tide"


def _nccl_delegate(store, rank, size, timeout):
    """Torch's NCCL backend for the standard ops on CUDA tensors, where CUDA and NCCL
    exist; None elsewhere (CUDA tensors then get a clear error)."""
    import torch

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("tide-nccl/", store), rank, size, options)
    if os.environ.get("TIDE_DEBUG", "0") not in ("", "0"):
        print(f"[tide] cuda: standard ops on CUDA tensors go to NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    return nccl


def create(store, rank, size, timeout, group_name, job_rank=-1):
    """A tide group and its delegates: what init_process_group / new_group get, and what
    ProcessGroupTide::split makes for dist.split_group. job_rank: this process's rank in the
    job (TIDE_LOCAL_WORLD_SIZE's pseudo-nodes split the job's ranks, so a sub-group, an HSDP
    replicate group say, keeps each rank's pseudo-node); -1: `rank`."""
    backend = _C.ProcessGroupTide(store, rank, size, timeout, str(group_name), job_rank)
    if backend.num_nodes() > 1:
        # Across nodes the CPU collectives run on torch's gloo (the host transport is one
        # host's), and it is TIDE's inter-node engine for FSDP2's collectives.
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("tide-gloo/", store), rank, size, timeout)
        backend.set_cpu_delegate(gloo)
        if os.environ.get("TIDE_DEBUG", "0") not in ("", "0"):
            print(f"[tide] group {group_name}: {backend.num_nodes()} nodes; CPU collectives "
                  f"go to gloo between them", flush=True)
    nccl = _nccl_delegate(store, rank, size, timeout)
    if nccl is not None:
        backend.set_cuda_delegate(nccl)
    return backend


def _create_backend(dist_opts, backend_opts):
    # extended_api=True: torch hands us its DistributedBackendOptions (store, ranks,
    # timeout and group name) and the backend options object, which tide does not use.
    job_ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    job_rank = job_ranks[dist_opts.group_rank] if len(job_ranks) == dist_opts.group_size else -1
    return create(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                  dist_opts.group_id, job_rank)


def register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


# torch 2.13 and 2.14 deprecate these two for the *_single functions they forward to
# (2.15 no longer does): TIDE calls whichever the running torch does not warn about, so a
# user never sees a warning for a call they did not write.
_SINGLE = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def c10d_function(name: str):
    """dist.<name>, or its *_single successor where the running torch deprecates it."""
    fn = getattr(dist, name)
    if getattr(fn, "__deprecated__", None) and hasattr(dist, _SINGLE[name]):
        return getattr(dist, _SINGLE[name])
    return fn
