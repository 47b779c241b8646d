"""Rules of the CUDA layer that no CPU can run but every CI run can read in its sources.

The first GPU run would have failed on them (issue: sticky cudaErrorNotReady): a
cudaEventQuery / cudaStreamQuery answer of cudaErrorNotReady stays behind as the thread's last
error, and a launch checked with cudaGetLastError() then reports it as its own failure (as do
torch's own launch checks after TIDE's polls). So:
- every poll goes through tide::cuda::event_done / stream_done (src/transport/cuda/check.cpp),
  which clear it;
- every kernel of kernels/ is launched through launch_kernel (kernels/launch.cuh:
  cudaLaunchKernelEx, whose result is the launch's own), never <<<...>>> followed by a
  cudaGetLastError() that could return someone else's error.
"""
from __future__ import annotations

import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CUDA_DIRS = ["src", "kernels", "benchmarks/gpu", "tests/gpu", "include"]
POLL_HELPER = "src/transport/cuda/check.cpp"


def _sources():
    for top in CUDA_DIRS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".cpp", ".hpp", ".cu", ".cuh", ".h")):
                    path = os.path.join(dirpath, f)
                    with open(path) as fh:
                        # Comments out: the rules are about code.
                        text = re.sub(r"//[^\n]*", "", fh.read())
                    yield os.path.relpath(path, ROOT), text


def test_every_poll_goes_through_the_helper_that_clears_not_ready():
    polls = [(path, m.group(0)) for path, text in _sources() if path != POLL_HELPER
             for m in re.finditer(r"\bcuda(Event|Stream)Query\s*\(", text)]
    assert not polls, f"poll outside tide::cuda::event_done / stream_done: {polls}"
    helper = dict(_sources())[POLL_HELPER]
    assert "cudaErrorNotReady" in helper and "cudaGetLastError" in helper


def test_kernels_launch_through_launch_kernel_and_return_their_own_result():
    for path, text in _sources():
        if path.startswith("kernels/") and path.endswith(".cu"):
            assert "<<<" not in text, f"{path}: a <<<...>>> launch (use launch_kernel: kernels/launch.cuh)"
        assert not re.search(r"return\s+cudaGetLastError\s*\(", text), \
            f"{path}: returns cudaGetLastError(), which may be an earlier call's error"
    launch = dict(_sources())["kernels/launch.cuh"]
    assert "cudaLaunchKernelEx" in launch
