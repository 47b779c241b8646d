"""TIDE's collectives launched as the c10d collectives stock FSDP2 calls in their place."""
from __future__ import annotations

import torch


def as_c10d(group, backend, device, kind, defer):
    """Runs a TIDE collective as the c10d collective stock FSDP2 calls in its place
    (c10d::_allgather_base_, c10d::_reduce_scatter_base_), so that CommDebugMode, the
    profiler and any TorchDispatchMode see FSDP2's collectives on a tide group as they do on
    NCCL or gloo: defer() keeps the checked call in the backend; the c10d call with
    zero-element tokens runs it. Returns its Work."""
    from .._backend import c10d_function

    out, inp = torch.empty(0, device=device), torch.empty(0, device=device)
    defer()
    try:
        if kind == "all_gather":
            return c10d_function("all_gather_into_tensor")(out, inp, group=group, async_op=True)
        return c10d_function("reduce_scatter_tensor")(out, inp, group=group, async_op=True)
    finally:
        backend.drop_deferred()  # nothing is left deferred, even if the call failed before running it
