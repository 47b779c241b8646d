"""TIDE-AG in place of FSDP2's all-gather, and the unsharded storages it fills: allocated
at the all-gather (from the CUDA pool with Slot-Reuse), freed through FSDP2's
free_unsharded_param, which every adapter replaces with the one here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _C
from ._c10d import as_c10d
from ._paths import count, device_index, debug, tide_backend, took_stock_path, why_not_all_gather
from ._record import record
from ._seams import originals
from ._state import group_states
from ._storage import HostPool


@dataclass
class _ZeroCopy:
    """Held by the empty marker TIDE-AG hands FSDP2 as its all-gather output."""
    works: list  # the Works of the group's other dtypes, waited for at the copy-out
    versions: list  # async: (fp, _shard_versions(fp)) at the unshard, checked at its wait


@torch.no_grad()  # as stock FSDP2's seams
def all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
               device, all_gather_comm, why_not=None):
    """TIDE-AG in place of FSDP2's foreach_all_gather (same arguments; `why_not` is an
    adapter's own reason to decline). Returns FSDP2's AllGatherResult, whose output is an
    empty marker: the data is already in every parameter's storage. Returns None where
    FSDP2's stock path must run instead (after saying why, for a tide group)."""
    backend = tide_backend(group, device)
    why = why_not if backend is not None and why_not else why_not_all_gather(
        fsdp_params, group, device, all_gather_comm, backend)
    parts = None
    if why is None:
        parts, why = group_states(fsdp_params, group, backend, device)
    if parts is None:
        took_stock_path("all_gather", why, fsdp_params, tide_group=backend is not None)
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult

    dtypes = [[fp.param_dtype or fp.orig_dtype] for fp in fsdp_params]
    numels = [[fp._sharded_param_data.numel()] for fp in fsdp_params]

    def alloc(stream=None):
        return _alloc_storages(fsdp_params, dtypes, numels, group.size(), device, backend, stream)

    def all_gather_each(storages):
        """One TIDE-AG per dtype of the group, in order; their Works."""
        return [as_c10d(group, backend, device, "all_gather", lambda st=st, idx=idx: backend.defer_param_all_gather(
            st.layout, st.shards, st.offsets, st.dtype, [storages[i] for i in idx])) for idx, st in parts]

    event = None
    if device.type == "cuda":
        # As stock FSDP2: the all-gather runs on its stream (overlapping compute when
        # prefetching) and the copy-out seam makes the current stream wait for its event.
        # The storages are allocated on that stream too; free_unsharded_param records
        # the compute stream on them before they go back to the allocator.
        if all_gather_stream != all_gather_copy_in_stream:
            all_gather_stream.wait_stream(all_gather_copy_in_stream)
        with torch.cuda.stream(all_gather_stream):
            storages = alloc(all_gather_stream)
            if storages is None:
                took_stock_path("all_gather", "the symmetric pool is full (across nodes the unsharded "
                                "storages must come from it: raise TIDE_CUDA_POOL_BYTES)",
                                fsdp_params, tide_group=True)
                return None
            for fp in fsdp_params:
                record(fp).on_all_gather_stream = True
            works = all_gather_each(storages)
            event = all_gather_stream.record_event()  # after every dtype's all-gather
        if not async_op:
            works = []
    else:
        storages = alloc()
        works = all_gather_each(storages)
        if not async_op:
            for w in works:
                w.wait()
            works = []
    nodes = backend.num_nodes()
    path = (f"across {nodes} nodes: inter-node over {backend.inter_node_engine(device_index(device))} "
            "(paced recursive doubling), node-local from the node's peers" if nodes > 1 else "node-local")
    debug(f"all-gather: zero-copy on {device.type}, {path}, {len(fsdp_params)} params into "
          "their own storage")
    count("zero_copy_all_gather", fsdp_params)
    # FSDP2 holds one Work per all-gather (and waits for it where it is a c10d Work): the
    # last dtype's; the others are waited for at the copy-out (finish_zero_copy).
    # TIDE-AG reads every shard where it lives, when the all-gather runs, not at the call
    # (stock FSDP2 copies the shards in at the call): with async_op, an in-place update of a
    # sharded parameter before the wait races with the peers' reads. Caught at the wait.
    marker = torch.empty(0)
    marker._tide_zero_copy = _ZeroCopy(
        works[:-1], [(fp, _shard_versions(fp)) for fp in fsdp_params] if async_op else [])
    work = works[-1] if works else None
    return AllGatherResult(marker, event, work, dtypes, numels, [n[0] for n in numels])


def _alloc_storages(fsdp_params, dtypes, numels, ws, device, backend, stream):
    """Each parameter's unsharded storage, as FSDP2 sizes it; from the CUDA pool where the
    group has one (Slot-Reuse), the block's pending events waited for on `stream`, or from
    the host pool across nodes (all of the call's storages from one pool). None where the
    CUDA pool is full across nodes."""
    storages = []
    for fp, dtype, numel in zip(fsdp_params, dtypes, numels):
        fp.init_all_gather_outputs(numel, dtype, ws, device)
    # Across nodes on the host: every storage of the call from one pool (HostPool), at once.
    host_blocks = {}
    on_host_pool = [fp for fp in fsdp_params
                    if isinstance(record(fp).state.pool, HostPool) and record(fp).pool_block is None]
    if on_host_pool:
        sizes = [fp.all_gather_outputs[0].numel() * fp.all_gather_outputs[0].element_size()
                 for fp in on_host_pool]
        host, offsets = record(on_host_pool[0]).state.pool.alloc_all(sizes)
        host_blocks = {id(fp): (host, off) for fp, off in zip(on_host_pool, offsets)}
    for fp in fsdp_params:
        storage, rec = fp.all_gather_outputs[0], record(fp)
        pool = rec.state.pool
        if id(fp) in host_blocks:
            _point_into_pool(rec, storage, *host_blocks[id(fp)])
        elif pool is not None and rec.pool_block is None:
            got = pool.alloc(storage.numel() * storage.element_size())
            if got is None:
                if backend.num_nodes() > 1:
                    # Node peers read the storages, so they must come from the pool. Every
                    # rank makes the same requests, so every rank gets here together.
                    return None
                fp.alloc_all_gather_outputs()
            else:  # Slot-Reuse on CUDA: the storage comes from the pool
                offset, events = got
                for event in events:
                    stream.wait_event(event)
                _point_into_pool(rec, storage, pool, offset)
        else:
            fp.alloc_all_gather_outputs()
        storages.append(storage)
    return storages


def _point_into_pool(rec, storage, pool, offset):
    """The storage's bytes become the pool's at `offset`; free_unsharded_param returns them."""
    nbytes = storage.numel() * storage.element_size()
    _C.point_storage(storage, pool.memory, pool.rank, offset, nbytes)
    rec.pool_block = (pool, offset, nbytes)


def free_unsharded_param(self):
    """FSDPParam.free_unsharded_param for storages homed in symmetric memory, and for CUDA
    storages TIDE-AG allocated on the all-gather stream: the caching allocator must not hand
    them out there again before the compute that read them on the current stream is done."""
    rec = record(self)
    if rec.pool_block is not None:
        pool, offset, nbytes = rec.pool_block
        rec.pool_block = None
        storage = self.all_gather_outputs[0] if self.all_gather_outputs else None
        if storage is not None and storage.data_ptr() == pool.base + offset:
            # Back to the pool, in stream order: the next user waits for this event.
            # On the host the all-gather and its readers are done (CPU ops are synchronous).
            event = (torch.cuda.current_stream(storage.device).record_event() if storage.is_cuda
                     else None)
            _C.point_storage(storage, pool.memory, pool.rank, 0, 0)
            pool.release(offset, nbytes, event)
            return
        # The storage moved on without us (the seams were uninstalled meanwhile, or FSDP2
        # recreated it): the block is free once the current stream is past this point.
        pool.release(offset, nbytes, torch.cuda.current_stream().record_event()
                     if pool.memory.device != "cpu" else None)
    if rec.storage_region is None or not self.all_gather_outputs:
        if rec.on_all_gather_stream:
            for tensor in self.all_gather_outputs:
                if tensor.is_cuda and tensor.untyped_storage().nbytes() > 0:
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return originals["FSDPParam.free_unsharded_param"](self)
    from torch.distributed.fsdp._fully_shard._fsdp_param import free_storage

    for tensor in self._unsharded_inner_tensors:
        free_storage(tensor)
    rec.state.storage.release(*rec.storage_region)


def make_foreach_all_gather(why_not):
    """FSDP2's foreach_all_gather seam (the same arguments from 2.11 to 2.15) running
    TIDE-AG; `why_not(fsdp_params)` is the adapter's own reason to decline, or None."""
    def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream,
                           all_gather_stream, device, all_gather_comm):
        args = (fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
                device, all_gather_comm)
        result = all_gather(*args, why_not=why_not(fsdp_params))
        return result if result is not None else originals["foreach_all_gather"](*args)
    return foreach_all_gather


def _shard_versions(fp):
    """What an in-place update of a sharded parameter changes: the DTensor's version counter
    (an update through the parameter, an optimizer's step) and its local data's (a write to
    the local tensor; DTensor's own ops do not reach that counter)."""
    return fp.sharded_param._version, fp._sharded_param_data._version


def is_zero_copy(all_gather_result) -> bool:
    return hasattr(all_gather_result.all_gather_output, "_tide_zero_copy")


def wait_all_gather(all_gather_result) -> None:
    """What FSDP2's copy-out does before copying: the current stream waits for the
    all-gather (CUDA), or the work is waited on. For TIDE-AG there is nothing to copy."""
    event, work = all_gather_result.all_gather_event, all_gather_result.all_gather_work
    if event is not None:  # CUDA: the current stream waits for the all-gather stream
        torch.cuda.current_stream().wait_event(event)
    if work is not None:
        work.wait()  # the shards are already in place: nothing to copy out
    finish_zero_copy(all_gather_result)


def finish_zero_copy(all_gather_result) -> None:
    """At the wait of an async TIDE-AG (every generation's copy-out seam calls this, after
    FSDP2's own wait): the other dtypes' all-gathers are waited for, and no sharded parameter
    was updated in place since the unshard."""
    zero_copy = all_gather_result.all_gather_output._tide_zero_copy
    for work in zero_copy.works:
        work.wait()
    for fp, versions in zero_copy.versions:
        if _shard_versions(fp) != versions:
            raise RuntimeError(
                f"tide FSDP2: the sharded parameter {fp._param_fqn or fp._module_info.param_name} was "
                "modified in place between unshard(async_op=True) and its wait(): TIDE-AG reads each "
                "shard where it lives while the all-gather runs, so the peers may have read it half "
                "updated. Wait for the unshard before updating parameters (or TIDE_FSDP=0 for FSDP2's "
                "copying path)")
