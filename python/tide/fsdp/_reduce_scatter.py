"""TIDE-RS in place of FSDP2's reduce-scatter (foreach_reduce), on CPU and CUDA tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._c10d import as_c10d
from ._hsdp import Hsdp
from ._paths import count, debug, device_index, tide_backend, took_stock_path, why_not_reduce_scatter
from ._record import record
from ._state import plan
from ._storage import vacated_storage


@dataclass
class Reduced:
    """What TIDE-RS hands back to FSDP2 (each adapter shapes it into its torch's tuple)."""
    reduce_scatter_event: object
    post_reduce_stream: object
    post_reduce_event: object
    all_reduce_input: object = None  # the output the HSDP all-reduce or a user's hook read (kept alive)
    all_reduce_event: object = None
    partial_reduce_output: object = None  # HSDP without all-reduce this step: the running sum


@torch.no_grad()  # as stock FSDP2's seams
def reduce_scatter(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor,
                   all_reduce_group, all_reduce_stream, partial_reduce_output, all_reduce_hook,
                   force_sum_reduction_for_comms, view_sharded_grads, run_post_accumulate_hooks,
                   why_not=None, all_reduce_grads=True):
    """TIDE-RS in place of FSDP2's foreach_reduce: reduce-scatters the per-parameter
    gradients, then (as stock) runs the all-reduce hook, post-divides, and accumulates
    `view_sharded_grads(reduce_output, fsdp_params, out_offsets, padded_numels)` (the
    adapter's torch casts and views the flat output its own way) into the sharded
    gradients. Returns a Reduced, or None where FSDP2's stock path must run instead (after
    saying why, for a tide group); `why_not` is an adapter's own reason to decline."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C

    backend = tide_backend(reduce_scatter_group, device)
    reduce_dtype = reduce_dtype or unsharded_grads[0].dtype
    predivide, postdivide, rs_op, all_reduce_op = C._get_gradient_divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, device.type,
        gradient_divide_factor, force_sum_reduction_for_comms)
    why = why_not_reduce_scatter(fsdp_params, unsharded_grads, reduce_scatter_group, device,
                                 reduce_scatter_comm, reduce_dtype, predivide, backend, why_not)
    if why is not None:
        took_stock_path("reduce_scatter", why, fsdp_params, tide_group=backend is not None)
        return None

    ws = reduce_scatter_group.size()
    state = record(fsdp_params[0]).state
    whole_group = (state is not None and state.world_size == ws
                   and len(state.param_refs) == len(fsdp_params)
                   and all(a is b for a, b in zip(state.params(), fsdp_params)))
    # fsdp_params are the group's parameters that have gradients: often all of them.
    layout = state.layout if whole_group else plan(fsdp_params, ws)
    padded = [lp.padded_shard_numel for lp in layout.params]
    out_offsets = [sum(padded[:i]) for i in range(len(padded))]

    def accumulate(reduce_output):
        """After the reduce-scatter, as stock foreach_reduce: hook, post-divide, then the
        adapter's cast and views, accumulated into (or set as) each sharded gradient."""
        if all_reduce_hook is not None:
            all_reduce_hook(reduce_output)
        C._div_if_needed(reduce_output, postdivide)
        views = view_sharded_grads(reduce_output, fsdp_params, out_offsets, padded)
        for fp, new_sharded_grad in zip(fsdp_params, views):
            if fp.sharded_param.grad is not None:
                fp.sharded_param.grad._local_tensor += new_sharded_grad
            else:
                fp.sharded_param.grad = fp.to_sharded_dtensor(new_sharded_grad)
            if run_post_accumulate_hooks:
                for hook in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {})
                             or {}).values():
                    hook(fp.sharded_param)

    hsdp = Hsdp(all_reduce_group, all_reduce_op, all_reduce_grads, partial_reduce_output)
    scatter = (reduce_scatter_group, backend, device, fsdp_params, unsharded_grads, layout,
               out_offsets, padded, reduce_dtype, rs_op)
    if device.type == "cuda":
        return _on_cuda(*scatter, reduce_scatter_stream, all_reduce_stream, all_reduce_hook,
                        accumulate, state.pool if state is not None else None, hsdp)
    return _on_cpu(*scatter, reduce_scatter_stream, accumulate, state, hsdp)


def _on_cpu(group, backend, device, fsdp_params, unsharded_grads, layout, out_offsets, padded,
            reduce_dtype, rs_op, reduce_scatter_stream, accumulate, state, hsdp):
    """TIDE-RS on the host, one per gradient dtype into its parameters' places of the one
    output; with host Slot-Reuse the staging goes into the group's vacated storages."""
    grads = [g.contiguous() for g in unsharded_grads]
    reduce_output = torch.empty(sum(padded), dtype=reduce_dtype, device=device)
    reuse, regions = vacated_storage(state)
    by_dtype: dict = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():
        sub = layout if len(by_dtype) == 1 else plan([fsdp_params[i] for i in indices], group.size())
        work = as_c10d(group, backend, device, "reduce_scatter",
                       lambda sub=sub, indices=indices: backend.defer_param_reduce_scatter(
                           sub, [grads[i] for i in indices], reduce_output, [out_offsets[i] for i in indices],
                           rs_op, reuse, regions))
        work.wait()
    for off, nbytes in regions:
        reuse.release(off, nbytes)  # staging done: the vacated storage is free again
    _done(fsdp_params, backend, device)
    del grads
    unsharded_grads.clear()  # autograd's gradients can go now
    all_reduce_input = None
    if hsdp.group is not None:
        partial = hsdp.running_sum(reduce_output)
        if partial is not None:
            event = torch.cpu.current_stream().record_event()
            return Reduced(event, reduce_scatter_stream, event, partial_reduce_output=partial)
        hsdp.all_reduce(reduce_output)
        all_reduce_input = reduce_output
    accumulate(reduce_output)
    event = torch.cpu.current_stream().record_event()
    return Reduced(event, reduce_scatter_stream, event, all_reduce_input,
                   event if all_reduce_input is not None else None)


def _on_cuda(group, backend, device, fsdp_params, unsharded_grads, layout, out_offsets, padded,
             reduce_dtype, rs_op, reduce_scatter_stream, all_reduce_stream, all_reduce_hook,
             accumulate, pool, hsdp):
    """TIDE-RS on FSDP2's reduce-scatter stream, as stock FSDP2 orders its own: after the
    backward compute that made the gradients, and with events for FSDP2 to wait on. With a
    pool (Slot-Reuse), the staging goes into pool memory the all-gathers vacated. HSDP as
    stock: the running sum on the reduce-scatter stream, the replicate all-reduce on the
    all-reduce stream."""
    grads = [g.contiguous() for g in unsharded_grads]
    reduce_scatter_stream.wait_stream(torch.cuda.current_stream(device))
    reuse, regions = None, []
    block = pool.alloc(pool.staging_bytes) if pool is not None else None
    with torch.cuda.stream(reduce_scatter_stream):
        if block is not None:
            offset, events = block
            for event in events:
                reduce_scatter_stream.wait_event(event)
            reuse, regions = pool.memory, [(offset, pool.staging_bytes)]
        reduce_output = torch.empty(sum(padded), dtype=reduce_dtype, device=device)
        try:
            as_c10d(group, backend, device, "reduce_scatter",
                    lambda: backend.defer_param_reduce_scatter(layout, grads, reduce_output,
                                                               out_offsets, rs_op, reuse, regions))
        finally:
            if block is not None:  # free again once this stream is past the reduce-scatter
                pool.release(block[0], pool.staging_bytes, reduce_scatter_stream.record_event())
        # The group's copy stream reads the gradients in place: they go back to the
        # allocator only after this stream's work so far (which waits for those reads).
        for g in grads:
            g.record_stream(reduce_scatter_stream)
        reduce_scatter_event = reduce_scatter_stream.record_event()
        _done(fsdp_params, backend, device)
        del grads
        unsharded_grads.clear()
        if hsdp.group is not None:  # the running sum stays on the reduce-scatter stream
            partial = hsdp.running_sum(reduce_output)
            if partial is not None:
                return Reduced(reduce_scatter_event, reduce_scatter_stream,
                               reduce_scatter_stream.record_event(), partial_reduce_output=partial)
    all_reduce_input = all_reduce_event = None
    post_reduce_stream = reduce_scatter_stream
    if hsdp.group is not None:
        post_reduce_stream = all_reduce_stream
        all_reduce_stream.wait_stream(reduce_scatter_stream)
        with torch.cuda.stream(all_reduce_stream):
            hsdp.all_reduce(reduce_output)
            # Held by FSDP2 until the all-reduce is done (no reuse of its memory before).
            all_reduce_input, all_reduce_event = reduce_output, all_reduce_stream.record_event()
    # As stock: a user's all-reduce hook and what follows run on the all-reduce stream.
    if all_reduce_hook is not None:
        all_reduce_stream.wait_stream(reduce_scatter_stream)
        post_reduce_stream = all_reduce_stream
    with torch.cuda.stream(post_reduce_stream):
        accumulate(reduce_output)
        post_reduce_event = post_reduce_stream.record_event()
    if all_reduce_input is None and all_reduce_hook is not None:
        # The hook read the output off the reduce-scatter stream: FSDP2 holds it until then.
        all_reduce_input, all_reduce_event = reduce_output, post_reduce_event
    return Reduced(reduce_scatter_event, post_reduce_stream, post_reduce_event,
                   all_reduce_input, all_reduce_event)


def _done(fsdp_params, backend, device):
    report = backend.last_staging_report()
    nodes = backend.num_nodes()
    engine = backend.inter_node_engine(device_index(device)) if nodes > 1 else ""
    path = (f"across {nodes} nodes: node-local into node partials, inter-node over {engine} "
            f"({report.partial_bytes} B of partials, {report.direct_bytes} B sent straight from the "
            f"gradients)" if nodes > 1 else "node-local")
    debug(f"reduce-scatter: zero-copy on {device.type}, {path}, {len(fsdp_params)} params, "
          f"staging {report.num_slots} x {report.slot_bytes} B ({report.reused_slots} in vacated "
          f"all-gather storage)")
    count("zero_copy_reduce_scatter", fsdp_params)
