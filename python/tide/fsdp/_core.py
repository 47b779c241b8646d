"""The zero-copy core of TIDE's FSDP2 integration, the same on every torch.

It knows FSDP2's objects (FSDPParam, its storages and dtypes) but not which torch release
calls it: the adapters beside it (``_gen_*.py``, one per FSDP2 generation) fit it into
that release's seams.

* TIDE-AG (``all_gather``): each rank's sharded parameters live in symmetric memory; every
  rank reads every shard straight from its owner into the parameter's own unsharded
  storage (``FSDPParam.all_gather_outputs``) at the planner's address, casting to the param
  dtype on the way. No copy-in, no flat buffer, no copy-out.
* TIDE-RS (``reduce_scatter``): each parameter's unsharded gradient (bf16 or fp32) is read
  directly and reduced over ranks, in fp32 and rank order, into the flat sharded-gradient
  output that FSDP2 views per parameter. No ``chunk_cat`` and no world_size x shard fp32
  buffer: staging is bounded and independent of the world size. With
  ``TIDE_SLOT_REUSE=1`` the staging goes into the layer's vacated all-gather storage
  (Slot-Reuse; on CUDA the storages then come from a symmetric pool, python/tide/_pool.py,
  and the staging from pool memory the all-gathers vacated).

On CUDA tensors (a tide build with CUDA) the same two paths run on the GPUs of the node
(src/torch/cuda, src/transport/cuda): the shards live in CUDA symmetric memory, copy
engines move them into the unsharded storages, and the reduce-scatter stages slices with
copy engines and accumulates them with a few short-lived CTAs. Everything is ordered on
FSDP2's own streams with events, as its stock path is; the host never waits for the GPU
(the ranks' CPUs meet once per collective for the argument check, TIDE_CUDA_CHECK_ARGS).
"""
from __future__ import annotations

import atexit
import os
import warnings
import weakref
from dataclasses import dataclass

import torch

from .. import _C

# Conversions the host transport does while copying / reducing (src/core/convert.hpp).
_HALF = (torch.bfloat16, torch.float16)
# How often each path ran in this process (tests check that the zero-copy path did run),
# in all and per param group (keyed by the fully qualified name of its first parameter: the
# all-gather sees the whole group and tells each parameter; a reduce-scatter may see only
# the parameters with gradients).
stats = {"zero_copy_all_gather": 0, "zero_copy_reduce_scatter": 0,
         "stock_all_gather": 0, "stock_reduce_scatter": 0}
stats_by_group: dict = {}


def _count(path: str, fsdp_params) -> None:
    stats[path] += 1
    fp = fsdp_params[0] if fsdp_params else None
    key = getattr(fp, "_tide_group_key", None) or (fp._param_fqn or fp._module_info.param_name) if fp else "?"
    if path.endswith("all_gather"):
        for other in fsdp_params:
            other._tide_group_key = key
    group = stats_by_group.setdefault(key, dict.fromkeys(stats, 0))
    group[path] += 1
# FSDP2's functions that the installed adapter replaced or wrapped, by name.
_originals: dict = {}
# What the core relies on in every generation ({target: {fingerprint: torch versions}},
# _fingerprint.py); each adapter adds its own.
KNOWN = {
    "foreach_all_gather": {"59ae7f8fa1082775": "2.11-2.15"},
    "FSDPParam.init_all_gather_outputs": {"798df254b89f0caa": "2.11, 2.12",
                                          "620e7828c7746ae1": "2.13-2.15"},
    "FSDPParam.alloc_all_gather_outputs": {"f7d1bb491a027ff5": "2.11-2.15"},
}
_ALIGN = 256  # byte alignment of each shard in symmetric memory (16-byte vector loads, cudaMalloc's)


def _debug(msg: str) -> None:
    if os.environ.get("TIDE_DEBUG", "0") not in ("", "0"):
        print(f"[tide] {msg}", flush=True)


_warned: set = set()


def _fallback(what: str, why: str) -> None:
    """A tide group taking FSDP2's stock path: one warning per reason, and a debug line."""
    _debug(f"{what}: stock FSDP2 path ({why})")
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"tide: FSDP2 {what} takes the stock (copying) path: {why}", stacklevel=3)


# ---- when TIDE's path applies ---------------------------------------------------------------
def _tide_backend(group, device):
    """The group's ProcessGroupTide where TIDE's path can serve `device`, else None."""
    if group is None or device.type not in ("cpu", "cuda"):
        return None
    if device.type == "cuda" and not _C.has_cuda:
        return None  # a tide built without CUDA: FSDP2's stock path over the NCCL delegate
    try:
        backend = group._get_backend(device)
    except (RuntimeError, ValueError):
        return None
    return backend if isinstance(backend, _C.ProcessGroupTide) else None


def _device_index(device) -> int:
    """-1 for host shared memory, else the CUDA device the symmetric memory goes on."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def _why_not_nodes(backend, device, collective):
    """None where TIDE's `collective` serves the group's nodes, else why not (TIDE-AG and
    TIDE-RS across nodes: gloo between the nodes for CPU tensors, NCCL for CUDA ones)."""
    nodes = backend.num_nodes()
    if nodes == 1:
        return None
    why = backend.why_not_across_nodes(_device_index(device))
    return f"the group spans {nodes} nodes and {why}" if why else None


def _why_not_cuda(backend, device):
    """On CUDA: None where the node's GPUs can map each other's memory, else why not."""
    if device.type != "cuda":
        return None
    path, reason = backend.cuda_path_choice(_device_index(device))
    return None if path != "nccl" else f"the GPUs cannot map each other's memory ({reason})"


def _why_not_all_gather(fsdp_params, group, device, all_gather_comm, backend):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if backend is None:
        return "not a tide group (or CUDA tensors with a tide built without CUDA)"
    if group.size() == 1:
        # Nothing to gather, and FSDP2 (2.11) never calls the copy-out seam at world size 1,
        # so on CUDA nothing would wait for TIDE-AG's event before FSDP2 writes the storage.
        return "world size 1"
    if (why := _why_not_nodes(backend, device, "all_gather")) is not None:
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
                                                 and param_dtype in _HALF):
            return f"casting {fp.orig_dtype} parameters to {param_dtype}"
    return None


# ---- per param-group state: the planner's layout and the symmetric shard home --------------
@dataclass
class _GroupState:
    param_refs: list  # weak references to the group's FSDPParams, in order (no cycle)
    layout: object  # tide._C.plan.GroupLayout
    shards: object  # tide._C.SymmetricMemory
    offsets: list  # bytes, per parameter
    home_ptrs: list  # where each parameter's sharded storage lives in `shards`
    dtype: torch.dtype
    world_size: int
    capacity: int = 0  # bytes of this rank's part of `shards`
    # Host Slot-Reuse: the unsharded storages (FSDPParam.all_gather_outputs) in symmetric
    # memory too, so that once vacated they can hold reduce-scatter staging; None when
    # FSDP2 had already allocated them before the group's first tide all-gather.
    storage: object = None
    storage_regions: list = None  # (offset, bytes) per parameter, page-aligned
    # CUDA with Slot-Reuse: the pool (shared by the groups of one process group and device)
    # that the unsharded storages and the reduce-scatter staging come from.
    pool: object = None


_PAGE = 4096


def _params(state):
    return [ref() for ref in state.param_refs]


def _plan(fsdp_params, world_size):
    params = []
    for fp in fsdp_params:
        params.append(_C.plan.Param(list(fp._orig_size), fp.orig_dtype.itemsize,
                                    fp.fsdp_placement.dim))
    return _C.plan.plan_group(params, world_size)


def _sharded_storage(fp):
    return fp._sharded_param_data.untyped_storage()


def _state_still_fits(state, fsdp_params, ws):
    """The group's shards keep their homes unless a parameter changed dtype or size
    (model.half(), load_state_dict(assign=True) with other tensors): then a new state."""
    if state.world_size != ws or len(state.param_refs) != len(fsdp_params):
        return False
    room = [b - a for a, b in zip(state.offsets, state.offsets[1:] + [state.capacity])]
    return all(fp.orig_dtype == state.dtype and _sharded_storage(fp).nbytes() <= r
               for fp, r in zip(fsdp_params, room))


def _group_state(fsdp_params, group, backend, device):
    """(state, None), or (None, why not). Created at the group's first all-gather (a
    collective point on every rank)."""
    state = getattr(fsdp_params[0], "_tide_state", None)
    ws = group.size()
    if state is not None and _state_still_fits(state, fsdp_params, ws):
        # A storage replaced since (load_state_dict(assign=True), _apply) moves in too.
        for i, fp in enumerate(fsdp_params):
            if _sharded_storage(fp).data_ptr() != state.home_ptrs[i]:
                _C.move_storage(fp._sharded_param_data, state.shards, group.rank(),
                                state.offsets[i])
        return state, None
    dtypes = {fp.orig_dtype for fp in fsdp_params}
    assert len(dtypes) == 1, dtypes  # _group_states splits a group by dtype
    if any(fp._sharded_param_data.storage_offset() != 0 for fp in fsdp_params):
        return None, "a sharded parameter that does not start its storage (storage_offset != 0)"
    dtype = dtypes.pop()
    homeable = device.type == "cpu" and not any(hasattr(fp, "_unsharded_param") for fp in fsdp_params)
    across_nodes = backend.num_nodes() > 1
    if across_nodes and device.type == "cpu" and not homeable:
        # Node peers read each other's unsharded storages: they must be symmetric memory.
        return None, "the unsharded parameters were allocated before TIDE's first all-gather"
    offsets, total = [], 0
    for fp in fsdp_params:
        offsets.append(total)
        total += (_sharded_storage(fp).nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
    shards = backend.allocate_symmetric(total, _device_index(device))
    for fp, off in zip(fsdp_params, offsets):
        # The storage itself moves: every tensor sharing it (the DTensor's local tensor, a
        # state_dict taken before training) keeps seeing the live parameter.
        _C.move_storage(fp._sharded_param_data, shards, group.rank(), off)
    home_ptrs = [_sharded_storage(fp).data_ptr() for fp in fsdp_params]
    state = _GroupState([weakref.ref(fp) for fp in fsdp_params], _plan(fsdp_params, ws),
                        shards, offsets, home_ptrs, dtype, ws, capacity=total)
    # Off by default on the host: the communicator's staging exists anyway, so reusing
    # vacated storage saves no memory there, and returning its pages at every reshard
    # costs page faults at every unshard (about 5% of the demo's step).
    slot_reuse = os.environ.get("TIDE_SLOT_REUSE", "0") != "0"
    if (slot_reuse or across_nodes) and device.type == "cuda":
        # The unsharded storages come from a symmetric pool (python/tide/_pool.py), so that
        # vacated ones can hold the reduce-scatter's staging, and, across nodes, so that
        # the node's peers can read them.
        state.pool = _cuda_pool(backend, device, state)
    elif (slot_reuse or across_nodes) and homeable:
        _home_unsharded_storages(state, group, backend)
    for fp in fsdp_params:
        fp._tide_state = state
    _debug(f"group of {len(fsdp_params)} params: shards moved to symmetric memory on "
           f"{shards.device} ({total} bytes per rank)")
    return state, None


def _group_states(fsdp_params, group, backend, device):
    """([(indices, state)], None): one state per parameter dtype of the group, in order of
    first appearance (the same on every rank: creating a state is collective), so a group
    of mixed dtypes (LoRA: a frozen bf16 base beside fp32 adapters) is all-gathered by one
    TIDE-AG per dtype; or (None, why not)."""
    by_dtype: dict = {}
    for i, fp in enumerate(fsdp_params):
        by_dtype.setdefault(fp.orig_dtype, []).append(i)
    parts = []
    for indices in by_dtype.values():
        state, why = _group_state([fsdp_params[i] for i in indices], group, backend, device)
        if state is None:
            return None, why
        parts.append((indices, state))
    return parts, None


# One pool per (process group backend, device), held until release_cuda_pools() or exit:
# whether a pool exists must not depend on when each rank's garbage collector ran, since
# creating one is collective.
_cuda_pools: dict = {}


def release_cuda_pools() -> None:
    """Frees the CUDA Slot-Reuse pools (every rank, at the same point: after the models
    that use them are gone, before their process group is destroyed)."""
    _cuda_pools.clear()


atexit.register(release_cuda_pools)


def _cuda_pool(backend, device, state):
    """The symmetric pool for this backend and device, created (collectively) by the first
    group that asks: TIDE_CUDA_POOL_BYTES, or twice that group's unsharded storages plus the
    reduce-scatter's staging, in 2 MiB units (every rank computes the same size). Size it
    to the peak of concurrently unsharded groups; what does not fit takes FSDP2's
    allocator."""
    from .._pool import SymmetricPool

    key = (id(backend), _device_index(device))
    pool = _cuda_pools.get(key)
    if pool is not None and pool.backend is backend:
        return pool
    slot_bytes, num_slots = backend.cuda_staging_geometry(_device_index(device))
    storages = sum(lp.storage_numel * (fp.param_dtype or fp.orig_dtype).itemsize
                   for fp, lp in zip(_params(state), state.layout.params))
    capacity = _C.env_bytes("TIDE_CUDA_POOL_BYTES", 0) or (
        2 * storages + slot_bytes * num_slots + 4096)
    capacity = (capacity + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    pool = SymmetricPool(backend.allocate_symmetric(capacity, _device_index(device)), capacity)
    pool.backend, pool.rank = backend, backend.rank()  # the backend outlives its pool's id
    pool.base = pool.memory.tensor(pool.rank, 0, 1, torch.uint8).data_ptr()
    pool.staging = (slot_bytes, num_slots)
    _cuda_pools[key] = pool
    _debug(f"cuda: a {capacity}-byte symmetric pool for unsharded storages and staging")
    return pool


def _home_unsharded_storages(state, group, backend):
    """Gives each parameter's unsharded storage a page-aligned home in symmetric memory.
    FSDP2 then allocates nothing (the storage already has its size) and frees it through
    _free_unsharded_param below, which returns the pages instead of resizing to 0."""
    regions, total = [], 0
    for fp, lp in zip(_params(state), state.layout.params):
        nbytes = lp.storage_numel * (fp.param_dtype or fp.orig_dtype).itemsize
        regions.append((total, nbytes))
        total += (nbytes + _PAGE - 1) // _PAGE * _PAGE
    state.storage = backend.allocate_symmetric(total)
    state.storage_regions = regions
    for fp, lp, (off, nbytes) in zip(_params(state), state.layout.params, regions):
        dtype = fp.param_dtype or fp.orig_dtype
        fp.all_gather_outputs = [state.storage.tensor(group.rank(), off, lp.storage_numel, dtype)]
        fp._tide_storage_region = (off, nbytes)
        state.storage.release(off, nbytes)  # unsharded storage starts out freed, as in FSDP2


def _free_unsharded_param(self):
    """FSDPParam.free_unsharded_param for storages homed in symmetric memory, and for CUDA
    storages TIDE-AG allocated on the all-gather stream: the caching allocator must not hand
    them out there again before the compute that read them on the current stream is done."""
    block = getattr(self, "_tide_pool_block", None)
    if block is not None:
        pool, offset, nbytes = block
        self._tide_pool_block = None
        storage = self.all_gather_outputs[0] if self.all_gather_outputs else None
        if storage is not None and storage.data_ptr() == pool.base + offset:
            # Back to the pool, in stream order: the next user waits for this event.
            event = torch.cuda.current_stream(storage.device).record_event()
            _C.point_storage(storage, pool.memory, pool.rank, 0, 0)
            pool.release(offset, nbytes, event)
            return
        # The storage moved on without us (the seams were uninstalled meanwhile, or FSDP2
        # recreated it): the block is free once the current stream is past this point.
        pool.release(offset, nbytes, torch.cuda.current_stream().record_event())
    region = getattr(self, "_tide_storage_region", None)
    if region is None or not self.all_gather_outputs:
        if getattr(self, "_tide_ag_stream_storage", False):
            for tensor in self.all_gather_outputs:
                if tensor.is_cuda and tensor.untyped_storage().nbytes() > 0:
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return _originals["FSDPParam.free_unsharded_param"](self)
    from torch.distributed.fsdp._fully_shard._fsdp_param import free_storage

    for tensor in self._unsharded_inner_tensors:
        free_storage(tensor)
    self._tide_state.storage.release(*region)


# ---- TIDE-AG ----------------------------------------------------------------------------------
@torch.no_grad()  # as stock FSDP2's seams
def all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
               device, all_gather_comm, why_not=None):
    """TIDE-AG in place of FSDP2's foreach_all_gather (same arguments; `why_not` is an
    adapter's own reason to decline). Returns FSDP2's AllGatherResult, whose output is an
    empty marker: the data is already in every parameter's storage. Returns None where
    FSDP2's stock path must run instead (after saying why, for a tide group)."""
    backend = _tide_backend(group, device)
    why = why_not if backend is not None and why_not else _why_not_all_gather(
        fsdp_params, group, device, all_gather_comm, backend)
    parts = None
    if why is None:
        parts, why = _group_states(fsdp_params, group, backend, device)
    if parts is None:
        if backend is not None and why != "world size 1":
            _fallback("all-gather", why)
        _count("stock_all_gather", fsdp_params)
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult

    ws = group.size()
    dtypes = [[fp.param_dtype or fp.orig_dtype] for fp in fsdp_params]
    numels = [[fp._sharded_param_data.numel()] for fp in fsdp_params]

    def alloc_storages(stream=None):
        storages = []
        for fp, dtype, numel in zip(fsdp_params, dtypes, numels):
            fp.init_all_gather_outputs(numel, dtype, ws, device)
            storage = fp.all_gather_outputs[0]
            got = None
            pool = fp._tide_state.pool
            if pool is not None and getattr(fp, "_tide_pool_block", None) is None:
                nbytes = storage.numel() * storage.element_size()
                got = pool.alloc(nbytes)
                if got is None and backend.num_nodes() > 1:
                    # Node peers read the storages, so they must come from the pool. Every
                    # rank makes the same requests, so every rank gets here together.
                    return None
            if got is not None:  # Slot-Reuse on CUDA: the storage comes from the pool
                offset, events = got
                for event in events:
                    stream.wait_event(event)
                _C.point_storage(storage, pool.memory, pool.rank, offset, nbytes)
                fp._tide_pool_block = (pool, offset, nbytes)
            else:
                fp.alloc_all_gather_outputs()
            storages.append(storage)
        return storages

    def all_gather_each(storages):
        """One TIDE-AG per dtype of the group, in order; their Works."""
        return [_as_c10d(group, backend, device, "all_gather", lambda st=st, idx=idx: backend.stage_param_all_gather(
            st.layout, st.shards, st.offsets, st.dtype, [storages[i] for i in idx])) for idx, st in parts]

    event = None
    if device.type == "cuda":
        # As stock FSDP2: the all-gather runs on its stream (overlapping compute when
        # prefetching) and the copy-out seam makes the current stream wait for its event.
        # The storages are allocated on that stream too; _free_unsharded_param records
        # the compute stream on them before they go back to the allocator.
        if all_gather_stream != all_gather_copy_in_stream:
            all_gather_stream.wait_stream(all_gather_copy_in_stream)
        with torch.cuda.stream(all_gather_stream):
            storages = alloc_storages(all_gather_stream)
            if storages is None:
                _fallback("all-gather", "the symmetric pool is full (across nodes the unsharded "
                          "storages must come from it: raise TIDE_CUDA_POOL_BYTES)")
                _count("stock_all_gather", fsdp_params)
                return None
            for fp in fsdp_params:
                fp._tide_ag_stream_storage = True
            works = all_gather_each(storages)
            event = all_gather_stream.record_event()  # after every dtype's all-gather
        if not async_op:
            works = []
    else:
        storages = alloc_storages()
        works = all_gather_each(storages)
        if not async_op:
            for w in works:
                w.wait()
            works = []
    nodes = backend.num_nodes()
    path = (f"across {nodes} nodes: inter-node over {backend.inter_node_engine(_device_index(device))} "
            "(paced recursive doubling), node-local from the node's peers" if nodes > 1 else "node-local")
    _debug(f"all-gather: zero-copy on {device.type}, {path}, {len(fsdp_params)} params into "
           "their own storage")
    _count("zero_copy_all_gather", fsdp_params)
    marker = torch.empty(0)
    marker._tide_zero_copy = True
    # FSDP2 holds one Work per all-gather (and waits for it where it is a c10d Work): the
    # last dtype's; the others are waited for at the copy-out (finish_zero_copy).
    work = works[-1] if works else None
    marker._tide_works = works[:-1]
    if async_op:
        # TIDE-AG reads every shard where it lives, when the all-gather runs, not at the call
        # (stock FSDP2 copies the shards in at the call): an in-place update of a sharded
        # parameter before the wait races with the peers' reads. Caught at the wait.
        marker._tide_versions = [(fp, _shard_versions(fp)) for fp in fsdp_params]
    return AllGatherResult(marker, event, work, dtypes, numels, [n[0] for n in numels])


def make_foreach_all_gather(why_not):
    """FSDP2's foreach_all_gather seam (the same arguments from 2.11 to 2.15) running
    TIDE-AG; `why_not(fsdp_params)` is the adapter's own reason to decline, or None."""
    def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream,
                           all_gather_stream, device, all_gather_comm):
        args = (fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
                device, all_gather_comm)
        result = all_gather(*args, why_not=why_not(fsdp_params))
        return result if result is not None else _originals["foreach_all_gather"](*args)
    return foreach_all_gather


def _shard_versions(fp):
    """What an in-place update of a sharded parameter changes: the DTensor's version counter
    (an update through the parameter, an optimizer's step) and its local data's (a write to
    the local tensor; DTensor's own ops do not reach that counter)."""
    return fp.sharded_param._version, fp._sharded_param_data._version


def is_zero_copy(all_gather_result) -> bool:
    return getattr(all_gather_result.all_gather_output, "_tide_zero_copy", False)


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
    for work in getattr(all_gather_result.all_gather_output, "_tide_works", ()):
        work.wait()
    for fp, versions in getattr(all_gather_result.all_gather_output, "_tide_versions", ()):
        if _shard_versions(fp) != versions:
            raise RuntimeError(
                f"tide FSDP2: the sharded parameter {fp._param_fqn or fp._module_info.param_name} was "
                "modified in place between unshard(async_op=True) and its wait(): TIDE-AG reads each "
                "shard where it lives while the all-gather runs, so the peers may have read it half "
                "updated. Wait for the unshard before updating parameters (or TIDE_FSDP=0 for FSDP2's "
                "copying path)")


# ---- TIDE-RS ----------------------------------------------------------------------------------
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

    backend = _tide_backend(reduce_scatter_group, device)
    grad_dtype = unsharded_grads[0].dtype
    grad_dtypes = {g.dtype for g in unsharded_grads}  # mixed: a torchtitan norm's fp32 beside bf16
    reduce_dtype = reduce_dtype or grad_dtype
    predivide, postdivide, rs_op, all_reduce_op = C._get_gradient_divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, device.type,
        gradient_divide_factor, force_sum_reduction_for_comms)
    why = None
    if backend is None:
        why = "not a tide group (or CUDA tensors with a tide built without CUDA)"
    elif reduce_scatter_group.size() == 1:
        why = "world size 1"
    elif why_not:
        why = why_not
    elif type(reduce_scatter_comm) is not C.DefaultReduceScatter:  # a subclass is the user's own
        why = (f"a custom reduce-scatter ({type(reduce_scatter_comm).__name__}, set_custom_reduce_scatter) "
               "is installed")
    elif predivide is not None:
        why = "pre-division for fp16 overflow safety"
    elif any(fp.offload_to_cpu for fp in fsdp_params):
        why = "CPU offload"
    elif bad := sorted(str(d) for d in grad_dtypes if not (
            reduce_dtype == d or (reduce_dtype == torch.float32 and d in _HALF))):
        why = f"reduce dtype {reduce_dtype} for {', '.join(bad)} gradients"
    elif device.type == "cuda" and len(grad_dtypes) > 1:
        why = "gradients of mixed dtypes on CUDA (one TIDE-RS per dtype runs on CPU tensors only)"
    elif (nodes_why := _why_not_nodes(backend, device, "reduce_scatter")) is not None:
        why = nodes_why
    elif (cuda_why := _why_not_cuda(backend, device)) is not None:
        why = cuda_why
    elif device.type == "cuda" and reduce_dtype != torch.float32:
        why = (f"reduce dtype {reduce_dtype} on CUDA (TIDE-RS reduces into fp32 shards: "
               "MixedPrecisionPolicy(reduce_dtype=torch.float32))")
    if why is not None:
        if backend is not None and why != "world size 1":
            _fallback("reduce-scatter", why)
        _count("stock_reduce_scatter", fsdp_params)
        return None

    ws = reduce_scatter_group.size()
    state = getattr(fsdp_params[0], "_tide_state", None)
    whole_group = (state is not None and state.world_size == ws
                   and len(state.param_refs) == len(fsdp_params)
                   and all(a is b for a, b in zip(_params(state), fsdp_params)))
    # fsdp_params are the group's parameters that have gradients: often all of them.
    layout = state.layout if whole_group else _plan(fsdp_params, ws)
    padded = [lp.padded_shard_numel for lp in layout.params]
    out_offsets = [sum(padded[:i]) for i in range(len(padded))]
    grads = [g.contiguous() for g in unsharded_grads]

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

    if device.type == "cuda":
        hsdp = _Hsdp(all_reduce_group, all_reduce_op, all_reduce_grads, partial_reduce_output)
        return _reduce_scatter_cuda(reduce_scatter_group, fsdp_params, grads, unsharded_grads,
                                    layout, out_offsets,
                                    padded, reduce_scatter_stream, all_reduce_stream,
                                    reduce_dtype, rs_op, all_reduce_hook, accumulate, backend,
                                    device, state.pool if state is not None else None, hsdp)
    reduce_output = torch.empty(sum(padded), dtype=reduce_dtype, device=device)
    reuse, regions = _vacated_storage(state)
    # One TIDE-RS per gradient dtype, each into its parameters' places of the one output.
    by_dtype: dict = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():
        sub = layout if len(by_dtype) == 1 else _plan([fsdp_params[i] for i in indices], ws)
        work = _as_c10d(reduce_scatter_group, backend, device, "reduce_scatter",
                        lambda sub=sub, indices=indices: backend.stage_param_reduce_scatter(
                            sub, [grads[i] for i in indices], reduce_output, [out_offsets[i] for i in indices],
                            rs_op, reuse, regions))
        work.wait()
    for off, nbytes in regions:
        reuse.release(off, nbytes)  # staging done: the vacated storage is free again
    _reduce_scatter_done(fsdp_params, backend, device)
    del grads
    unsharded_grads.clear()  # autograd's gradients can go now
    all_reduce_input = None
    if all_reduce_group is not None:
        # HSDP, as stock: without all-reduce this step the output only joins the running
        # sum; else the sum so far is added and the replicate group all-reduces (on a tide
        # group across nodes: gloo, the inter-node engine of the CPU path).
        if not all_reduce_grads:
            if partial_reduce_output is not None:
                partial_reduce_output += reduce_output
            else:
                partial_reduce_output = reduce_output
            event = torch.cpu.current_stream().record_event()
            return Reduced(event, reduce_scatter_stream, event, partial_reduce_output=partial_reduce_output)
        if partial_reduce_output is not None:
            reduce_output += partial_reduce_output
        import torch.distributed as dist

        dist.all_reduce(reduce_output, group=all_reduce_group, op=all_reduce_op)
        all_reduce_input = reduce_output
        _debug(f"reduce-scatter: HSDP all-reduce over the {all_reduce_group.size()}-rank replicate group")
    accumulate(reduce_output)
    event = torch.cpu.current_stream().record_event()
    return Reduced(event, reduce_scatter_stream, event, all_reduce_input,
                   event if all_reduce_input is not None else None)


def _as_c10d(group, backend, device, kind, stage):
    """Runs a TIDE collective as the c10d collective stock FSDP2 calls in its place
    (c10d::_allgather_base_, c10d::_reduce_scatter_base_), so that CommDebugMode, the
    profiler and any TorchDispatchMode see FSDP2's collectives on a tide group as they do on
    NCCL or gloo: stage() keeps the checked call in the backend; the c10d call with
    zero-element tokens runs it. Returns its Work."""
    from .._backend import c10d_function

    out, inp = torch.empty(0, device=device), torch.empty(0, device=device)
    stage()
    try:
        if kind == "all_gather":
            return c10d_function("all_gather_into_tensor")(out, inp, group=group, async_op=True)
        return c10d_function("reduce_scatter_tensor")(out, inp, group=group, async_op=True)
    finally:
        backend.unstage()  # nothing is left staged, even if the call failed before running it


def _reduce_scatter_done(fsdp_params, backend, device):
    report = backend.last_staging_report()
    nodes = backend.num_nodes()
    engine = backend.inter_node_engine(_device_index(device)) if nodes > 1 else ""
    path = (f"across {nodes} nodes: node-local into fp32 partials, inter-node over {engine} "
            f"({report.partial_bytes} B of partials)" if nodes > 1 else "node-local")
    _debug(f"reduce-scatter: zero-copy on {device.type}, {path}, {len(fsdp_params)} params, "
           f"staging {report.num_slots} x {report.slot_bytes} B ({report.reused_slots} in vacated "
           f"all-gather storage)")
    _count("zero_copy_reduce_scatter", fsdp_params)


@dataclass
class _Hsdp:
    """HSDP's replicate dimension, as FSDP2 hands it to foreach_reduce (group None: FSDP)."""
    group: object
    op: object
    all_reduce_grads: bool
    partial_reduce_output: object


def _reduce_scatter_cuda(group, fsdp_params, grads, unsharded_grads, layout, out_offsets, padded,
                         reduce_scatter_stream, all_reduce_stream, reduce_dtype, rs_op,
                         all_reduce_hook, accumulate, backend, device, pool, hsdp):
    """TIDE-RS on FSDP2's reduce-scatter stream, as stock FSDP2 orders its own: after the
    backward compute that made the gradients, and with events for FSDP2 to wait on. With a
    pool (Slot-Reuse), the staging goes into pool memory the all-gathers vacated. HSDP as
    stock: the running sum on the reduce-scatter stream, the replicate all-reduce (NCCL, the
    tide group's CUDA delegate) on the all-reduce stream."""
    reduce_scatter_stream.wait_stream(torch.cuda.current_stream(device))
    reuse, regions, block = None, [], None
    if pool is not None:
        slot_bytes, num_slots = pool.staging
        block = pool.alloc(slot_bytes * num_slots + 4096)  # + room to align the slots
    with torch.cuda.stream(reduce_scatter_stream):
        if block is not None:
            offset, events = block
            for event in events:
                reduce_scatter_stream.wait_event(event)
            reuse, regions = pool.memory, [(offset, slot_bytes * num_slots + 4096)]
        reduce_output = torch.empty(sum(padded), dtype=reduce_dtype, device=device)
        try:
            _as_c10d(group, backend, device, "reduce_scatter",
                     lambda: backend.stage_param_reduce_scatter(layout, grads, reduce_output,
                                                                out_offsets, rs_op, reuse, regions))
        finally:
            if block is not None:  # free again once this stream is past the reduce-scatter
                pool.release(block[0], slot_bytes * num_slots + 4096,
                             reduce_scatter_stream.record_event())
        # The group's copy stream reads the gradients in place: they go back to the
        # allocator only after this stream's work so far (which waits for those reads).
        for g in grads:
            g.record_stream(reduce_scatter_stream)
        reduce_scatter_event = reduce_scatter_stream.record_event()
        _reduce_scatter_done(fsdp_params, backend, device)
        del grads
        unsharded_grads.clear()
        if hsdp.group is not None:  # the running sum stays on the reduce-scatter stream
            partial = hsdp.partial_reduce_output
            if not hsdp.all_reduce_grads:
                if partial is not None:
                    partial += reduce_output
                else:
                    partial = reduce_output
                return Reduced(reduce_scatter_event, reduce_scatter_stream,
                               reduce_scatter_stream.record_event(), partial_reduce_output=partial)
            if partial is not None:
                reduce_output += partial
    all_reduce_input = all_reduce_event = None
    post_reduce_stream = reduce_scatter_stream
    if hsdp.group is not None:
        import torch.distributed as dist

        post_reduce_stream = all_reduce_stream
        all_reduce_stream.wait_stream(reduce_scatter_stream)
        with torch.cuda.stream(all_reduce_stream):
            dist.all_reduce(reduce_output, group=hsdp.group, op=hsdp.op)
            # Held by FSDP2 until the all-reduce is done (no reuse of its memory before).
            all_reduce_input, all_reduce_event = reduce_output, all_reduce_stream.record_event()
        _debug(f"reduce-scatter: HSDP all-reduce over the {hsdp.group.size()}-rank replicate group")
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


def _vacated_storage(state):
    """Slot-Reuse: the group's unsharded storages once FSDP2 has resharded them (it does so
    before reducing when reshard_after_backward is on)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if state is None or state.storage is None:
        return None, []
    if any(fp is None or fp.sharded_state != ShardedState.SHARDED for fp in _params(state)):
        return None, []
    return state.storage, list(state.storage_regions)
