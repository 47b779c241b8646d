"""Which path FSDP2's collectives take on a group: why TIDE's path does not apply (FSDP2's
stock path runs then, with one warning per reason on a tide group), how often each path
ran, and TIDE_DEBUG's log."""
from __future__ import annotations

import os
import warnings

import torch

from .. import _C
from ._record import record

# Conversions the host transport does while copying / reducing (src/core/convert.hpp).
HALF = (torch.bfloat16, torch.float16)
_NOT_TIDE = "not a tide group (or CUDA tensors with a tide built without CUDA)"
_WORLD_SIZE_1 = "world size 1"  # nothing to say: stock FSDP2 runs no collective either
# How often each path ran in this process (tests check that the zero-copy path did run),
# in all and per param group (keyed by the fully qualified name of its first parameter: the
# all-gather sees the whole group and tells each parameter; a reduce-scatter may see only
# the parameters with gradients).
stats = {"zero_copy_all_gather": 0, "zero_copy_reduce_scatter": 0,
         "stock_all_gather": 0, "stock_reduce_scatter": 0}
stats_by_group: dict = {}
_warned: set = set()


def count(path: str, fsdp_params) -> None:
    stats[path] += 1
    fp = fsdp_params[0] if fsdp_params else None
    key = record(fp).group_key or (fp._param_fqn or fp._module_info.param_name) if fp else "?"
    if path.endswith("all_gather"):
        for other in fsdp_params:
            record(other).group_key = key
    group = stats_by_group.setdefault(key, dict.fromkeys(stats, 0))
    group[path] += 1


def debug(msg: str) -> None:
    if os.environ.get("TIDE_DEBUG", "0") not in ("", "0"):
        print(f"[tide] {msg}", flush=True)


def took_stock_path(collective: str, why: str, fsdp_params, tide_group: bool) -> None:
    """Counts a collective ("all_gather", "reduce_scatter") taking FSDP2's stock path; on a
    tide group also one warning per reason, and a debug line."""
    what = collective.replace("_", "-")
    if tide_group and why != _WORLD_SIZE_1:
        debug(f"{what}: stock FSDP2 path ({why})")
        if why not in _warned:
            _warned.add(why)
            # stacklevel: the adapter's seam that called all_gather / reduce_scatter
            warnings.warn(f"tide: FSDP2 {what} takes the stock (copying) path: {why}", stacklevel=3)
    count(f"stock_{collective}", fsdp_params)


def tide_backend(group, device):
    """The group's ProcessGroupTide where TIDE's path can serve `device`, else None."""
    if group is None or device.type not in ("cpu", "cuda"):
        return None
    if device.type == "cuda" and not _C.has_cuda:
        return None  # a tide built without CUDA: FSDP2's stock path over the NCCL delegate
    try:
        backend = group._get_backend(device)
    except (RuntimeError, ValueError):
        return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend to check each collective's arguments
    # across ranks first; FSDP2's collectives still pass through the wrapper (the c10d calls
    # that run TIDE's kept ones), and TIDE's own calls go to the group under it.
    backend = getattr(backend, "wrapped_pg", backend)
    return backend if isinstance(backend, _C.ProcessGroupTide) else None


def device_index(device) -> int:
    """-1 for host shared memory, else the CUDA device the symmetric memory goes on."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def _why_not_nodes(backend, device):
    """None where TIDE's collectives serve the group's nodes, else why not (TIDE-AG and
    TIDE-RS across nodes: gloo between the nodes for CPU tensors, NCCL for CUDA ones)."""
    nodes = backend.num_nodes()
    if nodes == 1:
        return None
    why = backend.why_not_across_nodes(device_index(device))
    return f"the group spans {nodes} nodes and {why}" if why else None


def _why_not_cuda(backend, device):
    """On CUDA: None where the node's GPUs can map each other's memory, else why not."""
    if device.type != "cuda":
        return None
    path, reason = backend.cuda_path_choice(device_index(device))
    return None if path != "nccl" else f"the GPUs cannot map each other's memory ({reason})"


def why_not_all_gather(fsdp_params, group, device, all_gather_comm, backend):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if backend is None:
        return _NOT_TIDE
    if group.size() == 1:
        # Nothing to gather, and FSDP2 (2.11) never calls the copy-out seam at world size 1,
        # so on CUDA nothing would wait for TIDE-AG's event before FSDP2 writes the storage.
        return _WORLD_SIZE_1
    if (why := _why_not_nodes(backend, device)) is not None:
        return why
    if (why := _why_not_cuda(backend, device)) is not None:
        return why
    # Exactly FSDP2's default: a user's subclass of it (or torch's process-group / symmetric
    # memory allocating variants) is the user's choice, and runs as the user wrote it.
    if type(all_gather_comm) is not DefaultAllGather:
        return f"a custom all-gather ({type(all_gather_comm).__name__}, set_custom_all_gather) is installed"
    for fp in fsdp_params:
        if fp.sharded_state != ShardedState.SHARDED:
            return "parameters resharded to a smaller mesh after forward (reshard_after_forward=int)"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "a tensor subclass with fsdp_pre_all_gather"
        if type(fp._sharded_param_data) is not torch.Tensor or fp.offload_to_cpu:
            return "CPU offload or a tensor subclass"
        param_dtype = fp.param_dtype or fp.orig_dtype
        if param_dtype != fp.orig_dtype and not (fp.orig_dtype == torch.float32
                                                 and param_dtype in HALF):
            return f"casting {fp.orig_dtype} parameters to {param_dtype}"
    return None


def why_not_reduce_scatter(fsdp_params, unsharded_grads, group, device, reduce_scatter_comm,
                           reduce_dtype, predivide, backend, why_not):
    """None where TIDE-RS serves this foreach_reduce, else why not (`why_not`: the
    adapter's own reason to decline)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    grad_dtypes = {g.dtype for g in unsharded_grads}  # mixed: a torchtitan norm's fp32 beside bf16
    if backend is None:
        return _NOT_TIDE
    if group.size() == 1:
        return _WORLD_SIZE_1
    if why_not:
        return why_not
    if type(reduce_scatter_comm) is not DefaultReduceScatter:  # a subclass is the user's own
        return (f"a custom reduce-scatter ({type(reduce_scatter_comm).__name__}, "
                "set_custom_reduce_scatter) is installed")
    if predivide is not None:
        return "pre-division for fp16 overflow safety"
    if any(fp.offload_to_cpu for fp in fsdp_params):
        return "CPU offload"
    if bad := sorted(str(d) for d in grad_dtypes if not (
            reduce_dtype == d or (reduce_dtype == torch.float32 and d in HALF))):
        return f"reduce dtype {reduce_dtype} for {', '.join(bad)} gradients"
    if device.type == "cuda" and len(grad_dtypes) > 1:
        return "gradients of mixed dtypes on CUDA (one TIDE-RS per dtype runs on CPU tensors only)"
    if (why := _why_not_nodes(backend, device)) is not None:
        return why
    if (why := _why_not_cuda(backend, device)) is not None:
        return why
    if device.type == "cuda" and reduce_dtype != torch.float32:
        return (f"reduce dtype {reduce_dtype} on CUDA (TIDE-RS reduces into fp32 shards: "
                "MixedPrecisionPolicy(reduce_dtype=torch.float32))")
    return None
