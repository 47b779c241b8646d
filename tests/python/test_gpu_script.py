"""The GPU checks' own honesty, proven on any machine (tests/gpu): the dry run of the one
device command fits the lease, and strict mode turns every check that cannot run into a
failure that names it and why, in the C++ scenario runner and in pytest alike. On a GPU
machine the same checks must pass instead."""
import json
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
    # One command; its steps' limits, with each step's grace to end, within the 480 s the
    # machine's start leaves of the lease for one command (and under its own timeout_s).
    assert "one command: tests/gpu/run.sh  (device tool: carry [\"build/gpu-carry\"], timeout_s 480)" in run.stdout
    total = int(re.search(r"sum of all limits: (\d+) s \(with (\d+) s grace", run.stdout).group(1))
    grace = int(re.search(r"with (\d+) s grace", run.stdout).group(1))
    steps = re.findall(r"^  (\S.*?)\s+(\d+) s   ", run.stdout, re.M)
    assert sum(int(limit) + grace for _, limit in steps) == total <= 480, run.stdout
    # Most valuable first: the FSDP2-on-CUDA pytest before the scenarios, the benchmarks and
    # the paper's experiment last.
    names = [n for n, _ in steps]
    assert names.index("pytest cuda") < names.index("cuda scenarios") < names.index("benchmarks") \
        < names.index("bench step ws2") < names.index("bench step ws1") == len(names) - 1
    assert "carry: build/gpu-carry" in run.stdout
    unknown = subprocess.run(["bash", "tests/gpu/run.sh", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unexpected argument" in unknown.stderr


def test_strict_run_fails_naming_every_check_it_could_not_run(tmp_path):
    """The whole script here, strict: without a GPU (or a carried build) every step fails and
    says why; the results come back as JSON lines and a summary even so."""
    if GPU:
        pytest.skip("a GPU machine runs the script itself (tests/gpu/run.sh), not through this test")
    env = {**os.environ, "OUT": str(tmp_path), "TIDE_GPU_STRICT": "1"}
    run = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=900)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert run.returncode == len(summary) == 7, run.stdout[-3000:]
    assert all("FAIL (" in line for line in summary), summary
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {x.get("step") for x in lines if "verdict" in x} >= {"doctor", "pytest cuda", "cuda scenarios",
                                                                "gtest probe and kernels", "benchmarks",
                                                                "bench step ws2", "bench step ws1"}
    assert (tmp_path / "run.log").read_text().count("== ") >= 10, "run.log holds less than the run printed"


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
