"""What the adapters of torch 2.11 to 2.14 share (_gen_2_11.py, _gen_2_13.py): FSDP2 calls
three module-level seams and has no hooks. The all-gather and its copy-out are replaced
(TIDE-AG leaves nothing to copy out); TIDE-RS takes foreach_reduce's arguments, with the
group's orig_dtype, and each adapter shapes its result into its torch's return values."""
from __future__ import annotations

import torch

from . import _fingerprint
from ._all_gather import free_unsharded_param, is_zero_copy, make_foreach_all_gather, wait_all_gather
from ._reduce_scatter import reduce_scatter
from ._seams import originals

# What this code relies on beyond what it replaces (_seams.py), and its fingerprints.
READS = ("_fsdp_collectives:_to_dtype_if_needed", "_fsdp_common:compiled_autograd_enabled")
KNOWN = {
    "_fsdp_collectives:_to_dtype_if_needed": {"a18545d639d3242c": "2.11-2.14"},
    "_fsdp_common:compiled_autograd_enabled": {"69a3f2d5b1b14564": "2.11",
                                               _fingerprint.ABSENT: "2.12-2.14"},
}


def _compiled_autograd() -> bool:
    """torch 2.11's traceable FSDP2 (compiled autograd) takes other paths; 2.12 removed it."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    enabled = getattr(_fsdp_common, "compiled_autograd_enabled", None)
    return enabled is not None and enabled()


foreach_all_gather = make_foreach_all_gather(
    lambda _fsdp_params: "compiled autograd" if _compiled_autograd() else None)


def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    if not is_zero_copy(all_gather_result):
        return originals["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)
    wait_all_gather(all_gather_result)


def _views_in(orig_dtype):
    """Stock's view of the flat output, up to 2.14: one cast of the whole output to the
    group's orig_dtype, then a strided view per parameter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C

    def view(reduce_output, fsdp_params, out_offsets, _padded):
        output = C._to_dtype_if_needed(reduce_output, orig_dtype)
        return [torch.as_strided(output, size=fp.sharded_size, stride=fp.contiguous_sharded_stride,
                                 storage_offset=offset)
                for fp, offset in zip(fsdp_params, out_offsets)]
    return view


def _reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
            reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
            all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
            all_reduce_hook, force_sum_reduction_for_comms=False):
    """TIDE-RS with the arguments of foreach_reduce up to 2.14: a Reduced, or None."""
    return reduce_scatter(
        fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
        reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
        all_reduce_stream, partial_reduce_output, all_reduce_hook,
        force_sum_reduction_for_comms, _views_in(orig_dtype),
        run_post_accumulate_hooks=not _compiled_autograd(), all_reduce_grads=all_reduce_grads)


def seams(return_values) -> dict:
    """The patch table of an adapter whose foreach_reduce returns `return_values(reduced)`."""
    def foreach_reduce(*args, **kwargs):
        r = _reduce(*args, **kwargs)
        if r is None:
            return originals["foreach_reduce"](*args, **kwargs)
        return return_values(r)

    return {"foreach_all_gather": foreach_all_gather,
            "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
            "foreach_reduce": foreach_reduce,
            "FSDPParam.free_unsharded_param": free_unsharded_param}
