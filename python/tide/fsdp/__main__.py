"""``python -m tide.fsdp``: this torch's fingerprint of every target an adapter replaces or
relies on, and the adapters that know it (adding a torch release: _fingerprint.py)."""
from __future__ import annotations

import torch

from . import _GENERATIONS, _seams, uninstall
from ._fingerprint import fingerprint

uninstall()  # FSDP2's own functions, not TIDE's replacements
print(f"torch {torch.__version__}")
for target in dict.fromkeys(t for a in _GENERATIONS for t in _seams.targets(a)):
    got = fingerprint(target)
    known_to = [a.NAME for a in _GENERATIONS if target in _seams.targets(a)
                and got in {**_seams.KNOWN, **a.KNOWN}.get(target, {})]
    print(f"  {target}: {got}  known to: {', '.join(known_to) or 'none'}")
