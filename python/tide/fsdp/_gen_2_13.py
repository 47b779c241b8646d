"""FSDP2 of torch 2.13 and 2.14: the seams of 2.11, except that foreach_reduce returns
seven values (the post-reduce stream after the reduce-scatter event)."""
from __future__ import annotations

import torch

from . import _core
from ._gen_2_11 import foreach_all_gather, foreach_all_gather_copy_out, reduce

NAME = "2.13"
KNOWN = {
    "foreach_all_gather_copy_out": {"3e23d80c40ab5218": "2.12-2.14"},
    "foreach_reduce": {"d8008b79f123713c": "2.13, 2.14"},
    "FSDPParam.free_unsharded_param": {"e4f6a2474ee807e8": "2.12-2.14"},
}


def foreach_reduce(*args, **kwargs):
    r = reduce(*args, **kwargs)
    if r is None:
        return _core._originals["foreach_reduce"](*args, **kwargs)
    return (torch.empty(0), r.reduce_scatter_event, r.post_reduce_stream, r.post_reduce_event,
            r.all_reduce_input, r.all_reduce_event, r.partial_reduce_output)


SEAMS = {"foreach_all_gather": foreach_all_gather,
         "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
         "foreach_reduce": foreach_reduce}
