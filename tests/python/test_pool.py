"""SymmetricPool (python/tide/_pool.py): the sub-allocator behind Slot-Reuse on CUDA. Its
decisions must depend only on the requests (so every rank places blocks at the same
offsets) and its stream ordering must hand each block's pending events to the next user."""
from __future__ import annotations

import random

from tide._pool import ALIGN, SymmetricPool


class FakeEvent:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def run_trace(seed, capacity=1 << 20, steps=400, events_done=False):
    """A random alloc/free trace (decisions from `seed` only); returns the offsets."""
    rng = random.Random(seed)
    pool = SymmetricPool(None, capacity)
    live, offsets = {}, []
    for step in range(steps):
        if live and (rng.random() < 0.45 or len(live) > 20):
            key = rng.choice(sorted(live))
            off, n = live.pop(key)
            completed = rng.random() < 0.5  # drawn on both "ranks": same request stream
            pool.release(off, n, FakeEvent(done=events_done or completed))
        else:
            n = rng.randint(1, 70000)
            got = pool.alloc(n)
            offsets.append(None if got is None else got[0])
            if got is not None:
                live[step] = (got[0], n)
    return pool, live, offsets


def test_same_requests_same_offsets_whatever_the_events():
    # Two "ranks": same requests, different event completion: identical placements.
    _, _, a = run_trace(1, events_done=False)
    _, _, b = run_trace(1, events_done=True)
    assert a == b and any(o is not None for o in a)


def test_blocks_are_aligned_disjoint_and_inside():
    pool, live, _ = run_trace(2)
    spans = sorted((off, off + ((n + ALIGN - 1) // ALIGN) * ALIGN) for off, n in live.values())
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, f"blocks overlap: {spans}"
    assert all(off % ALIGN == 0 and end <= pool.capacity for off, end in spans)
    used = sum(end - off for off, end in spans)
    assert used + pool.free_bytes() == pool.capacity


def test_freeing_everything_coalesces_into_one_block():
    pool, live, _ = run_trace(3)
    for off, n in list(live.values()):
        pool.release(off, n, None)
    assert pool.free_bytes() == pool.capacity
    assert pool.alloc(pool.capacity) is not None  # one block again
    assert pool.alloc(1) is None  # and it is full


def test_the_next_user_waits_for_pending_events_only():
    pool = SymmetricPool(None, 2048)  # full after a and b: reuse must wait for events
    a = pool.alloc(1024)[0]
    b = pool.alloc(1024)[0]
    pending, done = FakeEvent(False), FakeEvent(True)
    pool.release(a, 1024, pending)
    pool.release(b, 1024, done)  # both rest; the next alloc merges them, dropping done events
    off, events = pool.alloc(2048)
    assert off == 0 and events == [pending]
    pending.done = True
    pool.release(0, 2048, FakeEvent(False))
    assert len(pool.alloc(512)[1]) == 1


def test_a_freed_block_rests_before_it_is_handed_out_again():
    """FSDP2 frees layer i's storage right before prefetching layer i+1's: the pool must not
    hand the same block back (that all-gather would wait for layer i's compute) while other
    memory fits, and must when nothing else does."""
    pool = SymmetricPool(None, 3 * 1024)
    a = pool.alloc(1024)[0]
    pool.release(a, 1024, FakeEvent(False))
    b = pool.alloc(1024)[0]
    assert b != a
    pool.release(b, 1024, FakeEvent(False))
    c = pool.alloc(1024)[0]
    assert c not in (a, b)
    d, events = pool.alloc(1024)  # full otherwise: the oldest freed block, with its event
    assert d == a and len(events) == 1
