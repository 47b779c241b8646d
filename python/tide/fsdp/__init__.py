"""Zero-copy FSDP2 on a ``tide`` process group, on every torch from 2.11 to 2.15.

FSDP2's param group calls module-level functions around its collectives
(``foreach_all_gather``, ``foreach_all_gather_copy_out``, ``foreach_reduce``), and from
torch 2.15 also per-group hooks. ``import tide`` fits TIDE's zero-copy core (TIDE-AG in
``_all_gather.py``, TIDE-RS in ``_reduce_scatter.py``) into them through one small adapter
per FSDP2 generation:

=================  ===========  =======================================================
adapter            torch        what it replaces
=================  ===========  =======================================================
``_gen_2_11.py``   2.11, 2.12   foreach_all_gather, foreach_all_gather_copy_out,
                                foreach_reduce (six return values)
``_gen_2_13.py``   2.13, 2.14   the same; foreach_reduce returns seven values
``_gen_2_15.py``   2.15         foreach_all_gather, foreach_reduce; the copy-out through
                                each param group's ``_all_gather_output_fn`` hook
=================  ===========  =======================================================

The adapter is chosen by what the running torch has, not by its version string: the
fingerprints (``_fingerprint.py``) of every function an adapter replaces (its ``SEAMS``)
or relies on (its ``READS`` and the core's, ``_seams.py``) must be ones it was written
against. A torch whose FSDP2 no adapter knows keeps its stock path over the tide backend,
with one warning naming what changed. Every replacement takes
TIDE's path only on tide groups and hands anything else to FSDP2's own function.

``TIDE_FSDP=0`` switches the replacement off.
"""
from __future__ import annotations

import os
import warnings

import torch

from . import _fingerprint, _gen_2_11, _gen_2_13, _gen_2_15, _paths, _seams
from ._paths import stats, stats_by_group
from ._storage import release_cuda_pools

__all__ = ["install", "uninstall", "release_cuda_pools", "stats", "stats_by_group", "generation"]

_GENERATIONS = (_gen_2_15, _gen_2_13, _gen_2_11)  # newest first
_installed = None  # the adapter module in use


def generation():
    """The FSDP2 generation whose adapter is installed ("2.11", "2.13", "2.15"), or None
    when FSDP2 runs its stock path."""
    return _installed.NAME if _installed is not None else None


_mismatches = _seams.mismatches  # (adapter) -> the targets it finds changed; doctor.py too


def install() -> bool:
    """Fits TIDE into this torch's FSDP2; returns False (with one warning saying why) when
    no adapter knows it."""
    global _installed
    if os.environ.get("TIDE_FSDP", "1") == "0":
        return False
    if _installed is not None:
        return True
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # noqa: F401
    except ImportError as e:
        warnings.warn(f"tide: FSDP2 not found ({e}); zero-copy FSDP2 is off", stacklevel=2)
        return False
    changed = {adapter.NAME: _mismatches(adapter) for adapter in _GENERATIONS}
    adapter = next((a for a in _GENERATIONS if not changed[a.NAME]), None)
    if adapter is None:
        closest = min(changed, key=lambda name: len(changed[name]))
        warnings.warn(
            f"tide: torch {torch.__version__} changed FSDP2's {changed[closest]} (against the "
            f"torch {closest} generation TIDE knows best); FSDP2 runs its stock path over the "
            "tide backend", stacklevel=2)
        return False
    for target, replacement in adapter.SEAMS.items():
        owner, name = _fingerprint.owner(target)
        _seams.originals[target] = getattr(owner, name)
        setattr(owner, name, replacement)
    _installed = adapter
    _paths.debug(f"FSDP2 of torch {torch.__version__}: the {adapter.NAME} adapter replaces "
                 f"{sorted(adapter.SEAMS)}")
    return True


def uninstall() -> None:
    """Gives FSDP2 back its own functions (param groups made meanwhile keep TIDE's output
    hook, which hands every result but TIDE-AG's to FSDP2's own copy-out)."""
    global _installed
    for target, original in _seams.originals.items():
        owner, name = _fingerprint.owner(target)
        setattr(owner, name, original)
    _seams.originals.clear()
    _installed = None
