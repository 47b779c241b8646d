"""Fingerprints of FSDP2's functions, so that TIDE replaces only seams it knows.

A seam can change under the same signature (torch 2.12 changed foreach_reduce's body,
2.13 its return value), so an adapter names, for every function it replaces or relies on
(_seams.targets), the fingerprints of the versions it was written and tested against. A
fingerprint is a hash of the function's (or class's) tokens without comments, blank lines
and line breaks inside brackets: an edit to a comment keeps it, any change to the code
does not. A target the torch does not have has the fingerprint ABSENT.

Adding a torch release: run this module with that torch
(``scripts/env python -m tide.fsdp``: every adapter's targets, each with its fingerprint
and the adapters that know it), read what changed in the functions whose
fingerprints are new, and either add them to the adapter that still fits or write a new
adapter (``_gen_<version>.py``).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import textwrap
import tokenize

ABSENT = "absent"

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
    if isinstance(fn, property):
        fn = fn.fget
    source = textwrap.dedent(inspect.getsource(fn))
    return hashlib.sha256("\x1f".join(_tokens(source)).encode()).hexdigest()[:16]


def owner(target: str):
    """(object, attribute name) of a target: a name in FSDP2's param-group module, the
    module that calls the seams ("foreach_reduce", "FSDPParam.free_unsharded_param",
    "FSDPParamGroup.__init__"), or "<module>:<name>" in another module of FSDP2's package
    ("_fsdp_collectives:_div_if_needed"). The object is None where this torch has no such
    module or class."""
    module, _, path = target.rpartition(":")
    try:
        obj = importlib.import_module(
            f"torch.distributed.fsdp._fully_shard.{module or '_fsdp_param_group'}")
    except ImportError:
        obj = None
    *parts, name = path.split(".")
    for part in parts:
        obj = getattr(obj, part, None)
    return obj, name


def resolve(target: str):
    """The object a target names, or None where this torch lacks it."""
    obj, name = owner(target)
    return getattr(obj, name, None)


def fingerprint(target: str) -> str | None:
    """The target's fingerprint; ABSENT where this torch lacks it, None where its source
    cannot be read (a compiled or frozen torch)."""
    fn = resolve(target)
    if fn is None:
        return ABSENT
    try:
        return source_hash(fn)
    except (OSError, TypeError):
        return None


def mismatches(targets, known: dict) -> list[str]:
    """The `targets` whose fingerprint in this torch is not among their `known` ones
    ({target: {fingerprint: torch versions}}); a target `known` lacks is one of them."""
    return [t for t in targets if fingerprint(t) not in known.get(t, {})]

