"""FSDP2 of torch 2.13 and 2.14: the seams of _pre_2_15.py, foreach_reduce returning seven
values (the post-reduce stream after the reduce-scatter event)."""
from __future__ import annotations

import torch

from . import _pre_2_15

NAME = "2.13"
SEAMS = _pre_2_15.seams(lambda r: (
    torch.empty(0), r.reduce_scatter_event, r.post_reduce_stream, r.post_reduce_event,
    r.all_reduce_input, r.all_reduce_event, r.partial_reduce_output))
READS = _pre_2_15.READS
KNOWN = {
    **_pre_2_15.KNOWN,
    "foreach_all_gather_copy_out": {"3e23d80c40ab5218": "2.12-2.14"},
    "foreach_reduce": {"d8008b79f123713c": "2.13, 2.14"},
    "FSDPParam.free_unsharded_param": {"e4f6a2474ee807e8": "2.12-2.14"},
}
