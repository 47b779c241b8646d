"""Each param group's state: the planner's layout and the symmetric home of its shards,
made at the group's first TIDE-AG (a collective point on every rank), one per parameter
dtype, and kept while the shards still fit."""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from .. import _C
from ._paths import debug, device_index
from ._record import record
from ._storage import cuda_pool, home_unsharded_storages, host_pool

_ALIGN = 256  # byte alignment of each shard in symmetric memory (16-byte vector loads, cudaMalloc's)


@dataclass
class GroupState:
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
    # that the unsharded storages and the reduce-scatter staging come from; on the host
    # across nodes, the HostPool (_storage.py) the unsharded storages come from.
    pool: object = None

    def params(self):
        return [ref() for ref in self.param_refs]

    def unsharded_bytes(self) -> list:
        """Each parameter's unsharded storage, in bytes (the planner's padded size)."""
        return [lp.storage_numel * (fp.param_dtype or fp.orig_dtype).itemsize
                for fp, lp in zip(self.params(), self.layout.params)]

    def still_fits(self, fsdp_params, ws) -> bool:
        """The group's shards keep their homes unless a parameter changed dtype or size
        (model.half(), load_state_dict(assign=True) with other tensors): then a new state."""
        if self.world_size != ws or len(self.param_refs) != len(fsdp_params):
            return False
        room = [b - a for a, b in zip(self.offsets, self.offsets[1:] + [self.capacity])]
        return all(fp.orig_dtype == self.dtype and _sharded_storage(fp).nbytes() <= r
                   for fp, r in zip(fsdp_params, room))


def plan(fsdp_params, world_size):
    params = [_C.plan.Param(list(fp._orig_size), fp.orig_dtype.itemsize, fp.fsdp_placement.dim)
              for fp in fsdp_params]
    return _C.plan.plan_group(params, world_size)


def _sharded_storage(fp):
    return fp._sharded_param_data.untyped_storage()


def _group_state(fsdp_params, group, backend, device):
    """(state, None), or (None, why not)."""
    state = record(fsdp_params[0]).state
    ws = group.size()
    if state is not None and state.still_fits(fsdp_params, ws):
        # A storage replaced since (load_state_dict(assign=True), _apply) moves in too.
        for i, fp in enumerate(fsdp_params):
            if _sharded_storage(fp).data_ptr() != state.home_ptrs[i]:
                _C.move_storage(fp._sharded_param_data, state.shards, group.rank(),
                                state.offsets[i])
        return state, None
    dtypes = {fp.orig_dtype for fp in fsdp_params}
    assert len(dtypes) == 1, dtypes  # group_states splits a group by dtype
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
    shards = backend.allocate_symmetric(total, device_index(device))
    for fp, off in zip(fsdp_params, offsets):
        # The storage itself moves: every tensor sharing it (the DTensor's local tensor, a
        # state_dict taken before training) keeps seeing the live parameter.
        _C.move_storage(fp._sharded_param_data, shards, group.rank(), off)
    home_ptrs = [_sharded_storage(fp).data_ptr() for fp in fsdp_params]
    state = GroupState([weakref.ref(fp) for fp in fsdp_params], plan(fsdp_params, ws),
                       shards, offsets, home_ptrs, dtype, ws, capacity=total)
    # Off by default on the host: the communicator's staging exists anyway, so reusing
    # vacated storage saves no memory there, and returning its pages at every reshard
    # costs page faults at every unshard (about 5% of the demo's step).
    slot_reuse = os.environ.get("TIDE_SLOT_REUSE", "0") != "0"
    if (slot_reuse or across_nodes) and device.type == "cuda":
        # The unsharded storages come from a symmetric pool (python/tide/_pool.py), so that
        # vacated ones can hold the reduce-scatter's staging, and, across nodes, so that
        # the node's peers can read them.
        state.pool = cuda_pool(backend, device, sum(state.unsharded_bytes()))
    elif across_nodes and homeable and not slot_reuse:
        # Node peers read the storages: they come from a node-symmetric pool that keeps its
        # pages (a home whose pages go back at each reshard costs page faults at each
        # unshard); the reduce-scatter stages in the node communicator's own slots.
        state.pool = host_pool(backend, sum(state.unsharded_bytes()))
    elif (slot_reuse or across_nodes) and homeable:
        state.storage, state.storage_regions = home_unsharded_storages(state, group, backend)
        for fp, region in zip(fsdp_params, state.storage_regions):
            record(fp).storage_region = region
    for fp in fsdp_params:
        record(fp).state = state
    debug(f"group of {len(fsdp_params)} params: shards moved to symmetric memory on "
          f"{shards.device} ({total} bytes per rank)")
    return state, None


def group_states(fsdp_params, group, backend, device):
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
