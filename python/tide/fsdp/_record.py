"""TIDE's record of each FSDPParam, kept beside it rather than on it (torch's object gets no
attribute of TIDE's): what TIDE knows of a parameter between FSDP2's calls."""
from __future__ import annotations

import weakref
from dataclasses import dataclass


@dataclass
class ParamRecord:
    group_key: str | None = None  # its param group's key in stats_by_group (_paths.count)
    state: object = None  # its _state.GroupState: the plan and its shard's symmetric home
    # Host Slot-Reuse: (offset, bytes) of its unsharded storage in state.storage.
    storage_region: tuple | None = None
    # CUDA Slot-Reuse: (pool, offset, bytes) of the pool block its unsharded storage has now.
    pool_block: tuple | None = None
    # CUDA: its unsharded storage was allocated on FSDP2's all-gather stream.
    on_all_gather_stream: bool = False
    # torch 2.15: its param group's all-gather output function (_gen_2_15.py).
    output_fn: object = None


# Weak keys: a record goes when its parameter does.
_records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(fsdp_param) -> ParamRecord:
    """The parameter's record; an empty one the first time it is asked for."""
    rec = _records.get(fsdp_param)
    if rec is None:
        rec = _records[fsdp_param] = ParamRecord()
    return rec
