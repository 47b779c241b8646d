"""FSDP2 of torch 2.11 and 2.12: the seams of _pre_2_15.py, foreach_reduce returning six
values."""
from __future__ import annotations

import torch

from . import _pre_2_15

NAME = "2.11"
SEAMS = _pre_2_15.seams(lambda r: (
    torch.empty(0), r.reduce_scatter_event, r.post_reduce_event, r.all_reduce_input,
    r.all_reduce_event, r.partial_reduce_output))
READS = _pre_2_15.READS
# {target: {fingerprint: torch versions}} of what this adapter replaces or relies on
# (_seams.py), beyond _seams.KNOWN.
KNOWN = {
    **_pre_2_15.KNOWN,
    "foreach_all_gather_copy_out": {"25761dcc97a970fd": "2.11", "3e23d80c40ab5218": "2.12-2.14"},
    "foreach_reduce": {"c13e3e3e28a4a6af": "2.11", "868cd847b842e88d": "2.12"},
    "FSDPParam.free_unsharded_param": {"c4a8931222a7f7f8": "2.11", "e4f6a2474ee807e8": "2.12-2.14"},
}
