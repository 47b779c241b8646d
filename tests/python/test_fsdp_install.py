"""How `import tide` hooks FSDP2, and how it declines to."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tide.fsdp as tf
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG


def test_import_installs_the_seams():
    assert PG.foreach_all_gather is tf.foreach_all_gather
    assert PG.foreach_reduce is tf.foreach_reduce


def test_tide_fsdp_0_leaves_fsdp2_alone():
    code = ("import tide, tide.fsdp as f; "
            "from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG; "
            "assert not f._originals and PG.foreach_reduce is not f.foreach_reduce")
    env = dict(os.environ, TIDE_FSDP="0")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_changed_seam_signature_falls_back_with_a_warning():
    tf.uninstall()
    original = PG.foreach_reduce
    try:
        PG.foreach_reduce = lambda fsdp_params, grads, new_argument: None
        with pytest.warns(UserWarning, match="changed FSDP2's"):
            assert tf.install() is False
        assert PG.foreach_all_gather is not tf.foreach_all_gather
    finally:
        PG.foreach_reduce = original
        assert tf.install() is True
