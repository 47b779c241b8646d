"""The GPU checks' own honesty, proven on any machine (tests/gpu): the dry run of the two
device commands fits the lease, and strict mode turns every check that cannot run into a
failure that names it and why, in the C++ scenario runner and in pytest alike. On a GPU
machine the same checks must pass instead."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPU = torch.cuda.is_available()


def test_dry_run_fits_the_lease():
    run = subprocess.run(["bash", "tests/gpu/run.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    # Each command's limits, with each step's grace to end, within 7.5 of the 8 minutes a
    # command may take (the summary is written after the last step).
    sums = [int(s) for s in re.findall(r"sum of limits, command \d: (\d+) s \(with (?:\d+) s grace", run.stdout)]
    assert len(sums) == 2 and all(s <= 450 for s in sums), run.stdout
    steps = re.findall(r"^  (\S.*?)\s+(\d+) s   ", run.stdout, re.M)
    grace = int(re.search(r"with (\d+) s grace", run.stdout).group(1))
    assert sum(int(limit) + grace for _, limit in steps) == sum(sums)
    assert {"cuda scenarios ws 1 2 4", "build tide._C", "doctor", "pytest cuda"} <= {n for n, _ in steps}
    assert "carry: build/gpu-carry" in run.stdout
    unknown = subprocess.run(["bash", "tests/gpu/run.sh", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown part" in unknown.stderr


def _selftest():
    build = os.environ.get("TIDE_BUILD") or os.path.join(ROOT, "build", "torch-" + torch.__version__.split("+")[0])
    path = os.path.join(build, "tide_cuda_selftest")
    if not os.path.exists(path):
        pytest.fail(f"{path} was not built (a build without CUDA?)")
    return path


def test_strict_scenarios_fail_by_name_without_a_device():
    args = [_selftest(), "--strict", "--limit", "60"]
    if GPU:  # a device: the strict run must pass
        run = subprocess.run(args + ["--only", "symmetric,ag_nodes_bf16", "2"], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout
        return
    run = subprocess.run(args + ["1", "4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout
    assert run.stdout.startswith("FAIL: no usable CUDA device: "), run.stdout
    not_run = run.stdout.splitlines()[1]
    assert "probe" in not_run and "ag_nodes_bf16 ws=4" in not_run and "rs_errors ws=1" in not_run
    relaxed = subprocess.run([_selftest(), "1"], capture_output=True, text=True, timeout=120)
    assert relaxed.returncode == 77 and relaxed.stdout.startswith("SKIP: ")  # a skip, never a pass
    typo = subprocess.run([_selftest(), "--only", "symetric", "1"], capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "unknown scenario symetric" in typo.stdout


def test_strict_pytest_fails_a_skipped_gpu_test():
    env = {**os.environ, "TIDE_STRICT_SKIPS": "1", "PYTHONPATH": os.path.join(ROOT, "python")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/python/test_cuda_backend.py"], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    if GPU:
        assert run.returncode == 0, run.stdout
    else:
        assert run.returncode != 0, run.stdout
        assert "skipped in strict mode" in run.stdout and "test_standard_ops_on_cuda_tensors_use_nccl" in run.stdout
