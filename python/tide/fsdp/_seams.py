"""FSDP2's functions that TIDE replaces (each adapter's SEAMS) or relies on (READS), and
the fingerprints they must have (_fingerprint.py): the targets an adapter is checked
against are derived from its tables, never listed again by hand.

A target is named as TIDE's code reaches it: a name in FSDP2's param-group module
("foreach_reduce", "FSDPParam.free_unsharded_param"), or "<module>:<name>" in another
module of FSDP2's package ("_fsdp_collectives:_div_if_needed")."""
from __future__ import annotations

from . import _fingerprint

# FSDP2's functions that the installed adapter replaced, by target.
originals: dict = {}

# What the core relies on in every generation, beyond what each adapter replaces.
READS = (
    "FSDPParam.init_all_gather_outputs",  # TIDE-AG sizes each unsharded storage with it
    "FSDPParam.alloc_all_gather_outputs",
    "FSDPParam._sharded_local_tensor",  # what a tensor subclass would pre-all-gather
    "FSDPParam.to_sharded_dtensor",  # each new sharded gradient, as stock's
    "_fsdp_collectives:AllGatherResult",  # what TIDE-AG returns
    "_fsdp_collectives:DefaultAllGather",  # TIDE runs only in place of these two
    "_fsdp_collectives:DefaultReduceScatter",
    "_fsdp_collectives:_get_gradient_divide_factors",  # TIDE-RS divides and reduces as stock
    "_fsdp_collectives:_div_if_needed",
    "_fsdp_param:ShardedState",
    "_fsdp_param:free_storage",  # frees a host-homed unsharded storage
)
# {target: {fingerprint: torch versions}} for the core's reads and the seams every
# generation replaces alike; an adapter's own KNOWN adds to it and takes precedence.
KNOWN = {
    "foreach_all_gather": {"59ae7f8fa1082775": "2.11-2.15"},
    "FSDPParam.init_all_gather_outputs": {"798df254b89f0caa": "2.11, 2.12",
                                          "620e7828c7746ae1": "2.13-2.15"},
    "FSDPParam.alloc_all_gather_outputs": {"f7d1bb491a027ff5": "2.11-2.15"},
    "FSDPParam._sharded_local_tensor": {"e7ee4d0347675b4d": "2.11-2.15"},
    "FSDPParam.to_sharded_dtensor": {"ee6b7b745234527d": "2.11-2.14", "8243c7147d4deabb": "2.15"},
    "_fsdp_collectives:AllGatherResult": {"c1859a3e73c13392": "2.11-2.15"},
    "_fsdp_collectives:DefaultAllGather": {"460632c15fa4f6f0": "2.11, 2.12",
                                           "36149a534d547886": "2.13-2.15"},
    "_fsdp_collectives:DefaultReduceScatter": {"3d74bb017fe88bc3": "2.11, 2.12",
                                               "7c0cc7074b56b1c3": "2.13",
                                               "4e45e4f17a75e084": "2.14, 2.15"},
    "_fsdp_collectives:_get_gradient_divide_factors": {"8b71ccf0a3ce69af": "2.11, 2.12",
                                                       "ebb889a60448ff04": "2.13-2.15"},
    "_fsdp_collectives:_div_if_needed": {"f15d07b20cfdc65b": "2.11-2.15"},
    "_fsdp_param:ShardedState": {"1c1983fb783e41a6": "2.11-2.15"},
    "_fsdp_param:free_storage": {"d17e3e8101487596": "2.11-2.15"},
}


def targets(adapter) -> list:
    """Everything `adapter` replaces or relies on, with the core's reads."""
    return list(dict.fromkeys([*adapter.SEAMS, *READS, *adapter.READS]))


def mismatches(adapter) -> list:
    """The targets of `adapter` that this torch lacks or has with another fingerprint."""
    return _fingerprint.mismatches(targets(adapter), {**KNOWN, **adapter.KNOWN})
