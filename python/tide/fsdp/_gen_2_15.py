"""FSDP2 of torch 2.15: the copy-out became a per-param-group hook
(FSDPParamGroup._all_gather_output_fn), and foreach_reduce lost orig_dtype, gained the
per-group prepare_reduce_scatter_inputs hook, returns seven values and casts each sharded
gradient to its parameter's grad dtype.

TIDE uses the copy-out hook: every param group gets TIDE's output function, which leaves
a TIDE-AG result in place (stock foreach_all_gather_copy_out still does the stream and work
waits) and hands any other result to the function the group had. The all-gather and the
reduce-scatter have no hook that reaches the copies (the reduce-scatter hook only reorders
gradients before FSDP2 packs them), so those two module functions are replaced."""
from __future__ import annotations

import torch

from ._all_gather import finish_zero_copy, free_unsharded_param, is_zero_copy, make_foreach_all_gather
from ._record import record
from ._reduce_scatter import reduce_scatter
from ._seams import originals

NAME = "2.15"


class _OutputFn:
    """A param group's all-gather output function: nothing to do for TIDE-AG's result,
    the group's own function (stock: the copy-out) for any other."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, fsdp_params, all_gather_result, world_size):
        if not is_zero_copy(all_gather_result):
            return self.inner(fsdp_params, all_gather_result, world_size)
        finish_zero_copy(all_gather_result)  # FSDP2 waited for its Work already


def _param_group_init(self, *args, **kwargs):
    originals["FSDPParamGroup.__init__"](self, *args, **kwargs)
    if not isinstance(self._all_gather_output_fn, _OutputFn):
        self._all_gather_output_fn = _OutputFn(self._all_gather_output_fn)
    for fp in self.fsdp_params:
        record(fp).output_fn = self._all_gather_output_fn  # seen by the all-gather below


def _why_not_all_gather(fsdp_params):
    # TIDE-AG only where the group's copy-out will leave its result alone: a group made
    # before `import tide` keeps FSDP2's own output function.
    if all(isinstance(record(fp).output_fn, _OutputFn) for fp in fsdp_params):
        return None
    return "the param group was created before `import tide`"


foreach_all_gather = make_foreach_all_gather(_why_not_all_gather)


def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor,
                   all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                   all_reduce_hook, force_sum_reduction_for_comms=False, *,
                   prepare_reduce_scatter_inputs=None):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C

    args = (fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
            reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
            all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
            force_sum_reduction_for_comms)
    prepare = prepare_reduce_scatter_inputs or C._default_reduce_scatter_input_fn
    # The default hook reorders Shard(i > 0) gradients for chunk_cat: the planner's
    # addressing does that. Another hook may do what TIDE-RS does not know.
    why_not = (None if prepare is C._default_reduce_scatter_input_fn
               else "a custom prepare_reduce_scatter_inputs hook")
    consumer_stream = torch.get_device_module(device.type).current_stream()

    def view(reduce_output, fsdp_params, _out_offsets, padded):
        # Stock 2.15: each run of parameters with one grad dtype is cast once and viewed.
        ws = reduce_scatter_group.size()
        C.record_grad_output_stream(reduce_output, consumer_stream)
        return C._cast_and_view_sharded_grads(
            reduce_output, fsdp_params, [torch.Size([n * ws]) for n in padded], ws,
            consumer_stream)

    r = reduce_scatter(
        fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
        reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor, all_reduce_group,
        all_reduce_stream, partial_reduce_output, all_reduce_hook,
        force_sum_reduction_for_comms, view, run_post_accumulate_hooks=True, why_not=why_not,
        all_reduce_grads=all_reduce_grads)
    if r is None:
        return originals["foreach_reduce"](
            *args, prepare_reduce_scatter_inputs=prepare)
    return (torch.empty(0), r.reduce_scatter_event, r.post_reduce_stream, r.post_reduce_event,
            r.all_reduce_input, r.all_reduce_event, r.partial_reduce_output)


SEAMS = {"foreach_all_gather": foreach_all_gather,
         "foreach_reduce": foreach_reduce,
         "FSDPParamGroup.__init__": _param_group_init,
         "FSDPParam.free_unsharded_param": free_unsharded_param}
# What this adapter relies on beyond what it replaces (_seams.py).
READS = ("_default_all_gather_output_fn",  # the output function TIDE's wraps
         "foreach_all_gather_copy_out",  # waits for the all-gather, then calls the output function
         "_fsdp_collectives:_default_reduce_scatter_input_fn",
         "_fsdp_collectives:record_grad_output_stream",
         "_fsdp_collectives:_cast_and_view_sharded_grads")
# {target: {fingerprint: torch versions}} of what this adapter replaces or relies on,
# beyond _seams.KNOWN.
KNOWN = {
    "foreach_all_gather_copy_out": {"91a85efb0db3703c": "2.15"},
    "_default_all_gather_output_fn": {"a109c9b3b0b1483d": "2.15"},
    "foreach_reduce": {"43688494339a2b36": "2.15"},
    "_fsdp_collectives:_default_reduce_scatter_input_fn": {"64b51dd62b84a3ea": "2.15"},
    "FSDPParam.free_unsharded_param": {"c0b7cb3778d544ef": "2.15"},
    "FSDPParamGroup.__init__": {"19e0a18d048bdc3b": "2.15"},
    "_fsdp_collectives:record_grad_output_stream": {"c0e6c7a8c4f93563": "2.15"},
    "_fsdp_collectives:_cast_and_view_sharded_grads": {"5365d8da055f2f09": "2.15"},
}
