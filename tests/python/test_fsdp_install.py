"""How `import tide` fits FSDP2 of each torch, and how it declines to."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import tide.fsdp as tf
from tide.fsdp import _fingerprint
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG

# Which adapter each torch release's FSDP2 needs (docs/status.md, "torch versions").
EXPECTED_GENERATION = {(2, 11): "2.11", (2, 12): "2.11", (2, 13): "2.13", (2, 14): "2.13",
                       (2, 15): "2.15"}
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def test_this_torch_gets_the_adapter_written_for_it():
    if TORCH not in EXPECTED_GENERATION:
        pytest.fail(f"torch {torch.__version__} is not in the table: add it (and its adapter)")
    assert tf.generation() == EXPECTED_GENERATION[TORCH]


def test_fingerprints_read_fstrings_as_their_source_text():
    """Python 3.12 splits an f-string into tokens (PEP 701) where 3.11 gives one STRING token;
    the fingerprint takes each f-string as its source text on both, so one torch has one
    fingerprint whichever Python runs it (CI runs 3.11, the GPU machine 3.12: before this,
    the same torch 2.11 looked changed there and FSDP2 silently took its stock path)."""
    src = ('def f(x, y):\n'
           '    a = f"a{x!r:>{y}}{{b}}" + F\'{x}\'\n'
           '    return f"""c\n{x + 1}""", rf"\\{y}" + "plain"\n')
    toks = _fingerprint._tokens(src)
    for literal in ['f"a{x!r:>{y}}{{b}}"', "F'{x}'", 'f"""c\n{x + 1}"""', 'rf"\\{y}"', '"plain"']:
        assert literal in toks, (literal, toks)
    assert toks.count("NEWLINE") == 3 and "+" in toks


def test_import_installs_the_adapters_seams():
    adapter = tf._installed
    for target, replacement in adapter.SEAMS.items():
        assert _fingerprint.resolve(target) is replacement, target
    assert PG.FSDPParam.free_unsharded_param is tf._all_gather.free_unsharded_param


def test_uninstall_restores_fsdp2_and_install_again():
    before = {t: _fingerprint.resolve(t) for t in tf._installed.SEAMS}
    tf.uninstall()
    try:
        for target, replacement in before.items():
            assert _fingerprint.resolve(target) is not replacement, target
        assert tf.generation() is None
    finally:
        assert tf.install() is True
    assert {t: _fingerprint.resolve(t) for t in before} == before


def test_tide_fsdp_0_leaves_fsdp2_alone():
    code = ("import tide, tide.fsdp as f; "
            "from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG; "
            "assert f.generation() is None and PG.foreach_reduce.__module__.startswith('torch')")
    env = dict(os.environ, TIDE_FSDP="0")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def _swap_and_install(new_foreach_reduce):
    tf.uninstall()
    original = PG.foreach_reduce
    try:
        PG.foreach_reduce = new_foreach_reduce
        with pytest.warns(UserWarning, match=r"changed FSDP2's \['foreach_reduce'\]"):
            assert tf.install() is False
        assert PG.foreach_all_gather.__module__.startswith("torch")
        assert tf.generation() is None
    finally:
        PG.foreach_reduce = original
        assert tf.install() is True


def test_changed_seam_signature_falls_back_with_a_warning():
    _swap_and_install(lambda fsdp_params, grads, new_argument: None)


def _function_from_source(source, tmp_path, name):
    """A function with a real source file (inspect.getsource reads it), as torch's are."""
    path = tmp_path / f"{name}_{abs(hash(source))}.py"
    path.write_text(source)
    namespace = {}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace[name]


def test_changed_seam_body_under_the_same_signature_falls_back_with_a_warning(tmp_path):
    """A torch that changes what foreach_reduce does but not its arguments (2.12 -> 2.13
    did, adding a return value) must not get a replacement written for the old body."""
    params = ", ".join(inspect.signature(PG.foreach_reduce).parameters)
    changed = _function_from_source(f"def foreach_reduce({params}):\n    return None\n",
                                    tmp_path, "foreach_reduce")
    assert list(inspect.signature(changed).parameters) == \
        list(inspect.signature(PG.foreach_reduce).parameters)
    _swap_and_install(changed)


def test_fingerprint_ignores_comments_and_layout_but_not_code(tmp_path):
    a = _function_from_source("def f(x):\n    # a comment\n    return max(x, 1)\n",
                              tmp_path, "f")
    b = _function_from_source("def f(x):\n\n    return max(x,\n               1)  # why\n",
                              tmp_path, "f")
    c = _function_from_source("def f(x):\n    return max(x, 2)\n", tmp_path, "f")
    assert _fingerprint.source_hash(a) == _fingerprint.source_hash(b)
    assert _fingerprint.source_hash(a) != _fingerprint.source_hash(c)
