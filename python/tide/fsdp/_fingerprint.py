"""Fingerprints of FSDP2's functions, so that TIDE replaces only seams it knows.

A seam can change under the same signature (torch 2.12 changed foreach_reduce's body,
2.13 its return value), so an adapter names, for every function it replaces or relies on,
the fingerprints of the versions it was written and tested against. A fingerprint is a
hash of the function's tokens without comments, blank lines and line breaks inside
brackets: an edit to a comment keeps it, any change to the code does not.

Adding a torch release: run this file with that torch
(``python python/tide/fsdp/_fingerprint.py``), read what changed in the functions whose
fingerprints differ, and either add the new fingerprints to the adapter that still fits or
write a new adapter (``_gen_<version>.py``).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import textwrap
import tokenize

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING}
# Python 3.12 tokenizes an f-string into FSTRING_START, its parts and FSTRING_END (PEP 701);
# earlier Pythons give one STRING token. Each f-string counts as its source text on every
# Python, so one torch has one fingerprint whichever Python runs it.
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


def _tokens(source: str) -> list[str]:
    lines = source.splitlines(keepends=True)

    def text(start, end):  # source between two (row, col) positions, rows from 1
        (r0, c0), (r1, c1) = start, end
        if r0 == r1:
            return lines[r0 - 1][c0:c1]
        return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]

    out, depth, fstring_start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if _FSTRING_START is not None and tok.type == _FSTRING_START:
            if depth == 0:
                fstring_start = tok.start
            depth += 1
            continue
        if depth:  # inside an f-string (nested ones too): its text is taken at its end
            if tok.type == _FSTRING_END:
                depth -= 1
                if depth == 0:
                    out.append(text(fstring_start, tok.end))
            continue
        if tok.type in _SKIP:
            continue
        out.append(tokenize.tok_name[tok.type] if tok.type in (
            tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE) else tok.string)
    return out


def source_hash(fn) -> str:
    source = textwrap.dedent(inspect.getsource(fn))
    return hashlib.sha256("\x1f".join(_tokens(source)).encode()).hexdigest()[:16]


def resolve(target: str):
    """A target is a name in FSDP2's param-group module, the module that calls the seams:
    "foreach_reduce", "FSDPParam.free_unsharded_param", "FSDPParamGroup.__init__"."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG

    owner, *path = target.split(".")
    obj = getattr(PG, owner, None)
    for name in path:
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


def mismatches(known: dict) -> list[str]:
    """The targets of `known` ({target: {fingerprint: versions}}) that this torch lacks or
    has with another fingerprint."""
    out = []
    for target, prints in known.items():
        fn = resolve(target)
        try:
            ok = fn is not None and source_hash(fn) in prints
        except (OSError, TypeError):  # no source (a compiled or frozen torch)
            ok = False
        if not ok:
            out.append(target)
    return out


if __name__ == "__main__":
    import sys

    import torch

    targets = sys.argv[1:] or [
        "foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce",
        "_default_all_gather_output_fn", "_default_reduce_scatter_input_fn",
        "FSDPParam.free_unsharded_param", "FSDPParam.init_all_gather_outputs",
        "FSDPParam.alloc_all_gather_outputs"]
    print(f"torch {torch.__version__}")
    for target in targets:
        fn = resolve(target)
        print(f"  {target}: {source_hash(fn) if fn is not None else 'missing'}")
