"""FSDP2 of torch 2.11 and 2.12: three module-level seams and no hooks. The all-gather and
its copy-out are replaced (TIDE-AG leaves nothing to copy out), and foreach_reduce, which
takes the group's orig_dtype and returns six values, is replaced by TIDE-RS."""
from __future__ import annotations

import torch

from . import _core

NAME = "2.11"
# {target: {fingerprint: torch versions}} of what this adapter replaces or relies on
# (_fingerprint.py), beyond _core.KNOWN.
KNOWN = {
    "foreach_all_gather_copy_out": {"25761dcc97a970fd": "2.11", "3e23d80c40ab5218": "2.12-2.14"},
    "foreach_reduce": {"c13e3e3e28a4a6af": "2.11", "868cd847b842e88d": "2.12"},
    "FSDPParam.free_unsharded_param": {"c4a8931222a7f7f8": "2.11", "e4f6a2474ee807e8": "2.12-2.14"},
}


def _compiled_autograd() -> bool:
    """torch 2.11's traceable FSDP2 (compiled autograd) takes other paths; 2.12 removed it."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    enabled = getattr(_fsdp_common, "compiled_autograd_enabled", None)
    return enabled is not None and enabled()


foreach_all_gather = _core.make_foreach_all_gather(
    lambda _fsdp_params: "compiled autograd" if _compiled_autograd() else None)


def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    if not _core.is_zero_copy(all_gather_result):
        return _core._originals["foreach_all_gather_copy_out"](all_gather_result, fsdp_params,
                                                                group)
    _core.wait_all_gather(all_gather_result)


def views_in(orig_dtype):
    """Stock's view of the flat output, up to 2.14: one cast of the whole output to the
    group's orig_dtype, then a strided view per parameter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C

    def view(reduce_output, fsdp_params, out_offsets, _padded):
        output = C._to_dtype_if_needed(reduce_output, orig_dtype)
        return [torch.as_strided(output, size=fp.sharded_size, stride=fp.contiguous_sharded_stride,
                                 storage_offset=offset)
                for fp, offset in zip(fsdp_params, out_offsets)]
    return view


def reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
           reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
           all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
           all_reduce_hook, force_sum_reduction_for_comms=False):
    """TIDE-RS with the arguments of foreach_reduce up to 2.14: a _core.Reduced, or None."""
    return _core.reduce_scatter(
        fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
        reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
        all_reduce_stream, partial_reduce_output, all_reduce_hook,
        force_sum_reduction_for_comms, views_in(orig_dtype),
        run_post_accumulate_hooks=not _compiled_autograd(), all_reduce_grads=all_reduce_grads)


def foreach_reduce(*args, **kwargs):
    r = reduce(*args, **kwargs)
    if r is None:
        return _core._originals["foreach_reduce"](*args, **kwargs)
    return (torch.empty(0), r.reduce_scatter_event, r.post_reduce_event, r.all_reduce_input,
            r.all_reduce_event, r.partial_reduce_output)


SEAMS = {"foreach_all_gather": foreach_all_gather,
         "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
         "foreach_reduce": foreach_reduce}
