"""A stream-ordered sub-allocator over one symmetric buffer, for FSDP2's unsharded storages
on CUDA (Slot-Reuse): its blocks live at the same offsets on every rank, because every rank
makes the same requests in the same order (FSDP2's schedule is the same program on every
rank) and the decisions depend only on those requests. So a storage vacated at reshard is
memory every peer can address, and the reduce-scatter can stage in it.

Freeing is stream-ordered, as in torch's caching allocator: a freed block carries the
events recorded on the streams that last used it, and whoever takes it next makes its own
stream wait for them. Events never influence where a block goes (they differ per rank).

Freed blocks rest in a FIFO quarantine before they can be handed out again, oldest first
and only when nothing else fits: FSDP2 frees layer i's storage right before it prefetches
layer i+1's, and handing back the same block would make that all-gather wait for layer i's
compute (the caching allocator avoids the same trap with record_stream).
"""
from __future__ import annotations

import torch

from . import _C

ALIGN = 256  # bytes: 16-byte vector loads, copy-engine friendly
_UNIT = 2 << 20  # a backend-made pool's size is a multiple of this


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _staging_bytes(geometry) -> int:
    slot_bytes, num_slots = geometry
    return slot_bytes * num_slots + 4096  # + room to align the slots


class SymmetricPool:
    """First-fit over [0, capacity) with coalescing; see the module docstring."""

    def __init__(self, memory, capacity: int, backend=None, staging=(0, 0)):
        self.memory = memory  # tide._C.SymmetricMemory (or anything, for the tests)
        self.capacity = capacity
        # The backend whose symmetric memory this is (it outlives the pool's id), and this
        # rank's address of offset 0 (to recognise a storage that still points here).
        self.backend = backend
        self.rank = backend.rank() if backend is not None else 0
        self.base = (memory.tensor(self.rank, 0, 1, torch.uint8).data_ptr()
                     if backend is not None else 0)
        # The block one reduce-scatter's staging takes: staging is (slot bytes, slots).
        self.staging_bytes = _staging_bytes(staging)
        self._free = [[0, capacity, []]]  # [offset, size, events], sorted by offset
        self._quarantine = []  # [offset, size, events], oldest first

    @classmethod
    def on_backend(cls, backend, device_index: int, storage_bytes: int):
        """A pool in `backend`'s symmetric memory on a CUDA device (collective: every rank
        computes the same size), for unsharded storages and the reduce-scatter's staging:
        TIDE_CUDA_POOL_BYTES, or twice `storage_bytes` plus one staging, in 2 MiB units."""
        staging = backend.cuda_staging_geometry(device_index)
        capacity = _C.env_bytes("TIDE_CUDA_POOL_BYTES", 0) or (
            2 * storage_bytes + _staging_bytes(staging))
        capacity = _round_up(capacity, _UNIT)
        return cls(backend.allocate_symmetric(capacity, device_index), capacity, backend, staging)

    def alloc(self, nbytes: int):
        """(offset, events to wait for) of a block of at least nbytes, or None when full."""
        n = _round_up(max(nbytes, 1))
        while True:
            got = self._first_fit(n)
            if got is not None or not self._quarantine:
                return got
            self._insert(*self._quarantine.pop(0))  # the oldest freed block becomes usable

    def _first_fit(self, n: int):
        for i, (off, size, events) in enumerate(self._free):
            if size < n:
                continue
            if size == n:
                del self._free[i]
            else:
                self._free[i] = [off + n, size - n, list(events)]
            return off, [e for e in events if not e.query()]
        return None

    def release(self, offset: int, nbytes: int, event) -> None:
        """Gives a block back; `event` (recorded on the stream that used it last) must
        complete before the memory is used again."""
        n = _round_up(max(nbytes, 1))
        for off, size, _ in self._quarantine:
            assert offset + n <= off or off + size <= offset, "tide: pool: double free or overlap"
        self._quarantine.append([offset, n, [event] if event is not None else []])

    def _insert(self, offset: int, n: int, events: list) -> None:
        i = 0
        while i < len(self._free) and self._free[i][0] < offset:
            i += 1
        if i > 0:
            prev = self._free[i - 1]
            assert prev[0] + prev[1] <= offset, "tide: pool: double free or overlap"
        if i < len(self._free):
            assert offset + n <= self._free[i][0], "tide: pool: double free or overlap"
        self._free.insert(i, [offset, n, events])
        # Coalesce with the neighbours; events of merged blocks stay (pending ones only).
        if i + 1 < len(self._free) and offset + n == self._free[i + 1][0]:
            nxt = self._free.pop(i + 1)
            self._free[i][1] += nxt[1]
            self._free[i][2] += nxt[2]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            cur = self._free.pop(i)
            self._free[i - 1][1] += cur[1]
            self._free[i - 1][2] += cur[2]
            i -= 1
        self._free[i][2] = [e for e in self._free[i][2] if not e.query()]

    def free_bytes(self) -> int:
        return sum(size for _, size, _ in self._free) + sum(size for _, size, _ in self._quarantine)
