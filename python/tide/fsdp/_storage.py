"""Homes in symmetric memory for FSDP2's unsharded storages (FSDPParam.all_gather_outputs),
so that once FSDP2 has resharded them they can hold the reduce-scatter's staging
(Slot-Reuse) and, across nodes, the node's peers can read them: on the host a page-aligned
home per parameter, on CUDA a pool per process group and device (python/tide/_pool.py)."""
from __future__ import annotations

import atexit

from .._pool import _UNIT, SymmetricPool, _round_up
from ._paths import debug, device_index

_PAGE = 4096

# One pool per (process group backend, device), held until release_cuda_pools() or exit:
# whether a pool exists must not depend on when each rank's garbage collector ran, since
# creating one is collective.
_cuda_pools: dict = {}


def release_cuda_pools() -> None:
    """Frees the CUDA Slot-Reuse pools (every rank, at the same point: after the models
    that use them are gone, before their process group is destroyed)."""
    _cuda_pools.clear()


atexit.register(release_cuda_pools)


def cuda_pool(backend, device, storage_bytes: int):
    """The symmetric pool for this backend and device, created (collectively) by the first
    group that asks, sized by its `storage_bytes` of unsharded storages (SymmetricPool.
    on_backend). Size it to the peak of concurrently unsharded groups
    (TIDE_CUDA_POOL_BYTES); what does not fit takes FSDP2's allocator."""
    key = (id(backend), device_index(device))
    pool = _cuda_pools.get(key)
    if pool is not None and pool.backend is backend:
        return pool
    pool = _cuda_pools[key] = SymmetricPool.on_backend(backend, device_index(device), storage_bytes)
    debug(f"cuda: a {pool.capacity}-byte symmetric pool for unsharded storages and staging")
    return pool


class HostPool:
    """Across nodes on the host: the unsharded storages of a process group's FSDP2 groups in
    node-symmetric memory (node peers read them) that keeps its pages. Storages are blocks
    of a SymmetricPool, taken at each all-gather and given back at each reshard, so the next
    group's all-gather writes into pages that are already resident: a home per storage whose
    pages are returned at each reshard (home_unsharded_storages) costs its page faults at
    every unshard (one 2.7 MiB layer across 2 pseudo-nodes on the 2-core build machine:
    2.0 ms into resident pages, 5.8 ms into returned ones). Every rank makes the same requests in the same order, so
    the blocks lie at the same offsets on every rank. All storages of one all-gather come
    from one pool (one home, as node peers find them); a request the current pool cannot
    hold makes a new pool (collective: every rank gets there together) of twice what the
    current one holds plus the request, and the old one goes once its blocks are back."""

    def __init__(self, backend, storage_bytes: int):
        self.backend = backend
        self.current = self._new(storage_bytes)

    def _new(self, nbytes: int):
        capacity = _round_up(max(nbytes, 1), _UNIT)
        pool = SymmetricPool(self.backend.allocate_symmetric(capacity), capacity, self.backend)
        debug(f"host: a {capacity}-byte node-symmetric pool for unsharded storages")
        return pool

    def alloc_all(self, sizes: list):
        """(pool, [offset per size]): blocks for all `sizes` (bytes) in one pool."""
        got = self._try(self.current, sizes)
        if got is None:
            held = self.current.capacity - self.current.free_bytes()
            self.current = self._new(2 * (held + sum(_round_up(max(n, 1)) for n in sizes)))
            got = self._try(self.current, sizes)
            assert got is not None, (sizes, self.current.capacity)
        return self.current, got

    @staticmethod
    def _try(pool, sizes):
        offsets = []
        for n in sizes:
            got = pool.alloc(n)
            if got is None:
                for off, m in zip(offsets, sizes):
                    pool.release(off, m, None)
                return None
            offsets.append(got[0])
        return offsets


_host_pools: dict = {}


def host_pool(backend, storage_bytes: int):
    """The HostPool of this backend, made (collectively) by the first group that asks, with
    room for twice its `storage_bytes`."""
    pool = _host_pools.get(id(backend))
    if pool is not None and pool.backend is backend:
        return pool
    pool = _host_pools[id(backend)] = HostPool(backend, 2 * storage_bytes)
    return pool


def release_host_pools() -> None:
    _host_pools.clear()


atexit.register(release_host_pools)


def home_unsharded_storages(state, group, backend):
    """Gives each parameter of `state` a page-aligned home for its unsharded storage in new
    host symmetric memory; returns (that memory, each parameter's (offset, bytes) in it).
    FSDP2 then allocates nothing (the storage already has its size) and frees it through
    TIDE's free_unsharded_param, which returns the pages instead of resizing to 0."""
    regions, total = [], 0
    for nbytes in state.unsharded_bytes():
        regions.append((total, nbytes))
        total += (nbytes + _PAGE - 1) // _PAGE * _PAGE
    storage = backend.allocate_symmetric(total)
    for fp, lp, (off, nbytes) in zip(state.params(), state.layout.params, regions):
        dtype = fp.param_dtype or fp.orig_dtype
        fp.all_gather_outputs = [storage.tensor(group.rank(), off, lp.storage_numel, dtype)]
        storage.release(off, nbytes)  # unsharded storage starts out freed, as in FSDP2
    return storage, regions


def vacated_storage(state):
    """Slot-Reuse on the host: (memory, regions) of the group's unsharded storages once
    FSDP2 has resharded them (it does so before reducing when reshard_after_backward is
    on), else (None, [])."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if state is None or state.storage is None:
        return None, []
    if any(fp is None or fp.sharded_state != ShardedState.SHARDED for fp in state.params()):
        return None, []
    return state.storage, list(state.storage_regions)
