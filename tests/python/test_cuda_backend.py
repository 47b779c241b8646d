"""CUDA tensors on a tide group: standard ops go to the NCCL delegate. Needs a GPU; NCCL
refuses two ranks on one device, so on a single GPU this runs at world size 1."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def cuda_ops_worker(rank, ws):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    x = torch.randn(1 << 16, device="cuda")
    want = x.clone()
    dist.all_reduce(x)
    out = torch.empty(x.numel() * ws, device="cuda")
    dist.all_gather_into_tensor(out, x)
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    return (torch.allclose(x, want * ws), torch.equal(out[: x.numel()], x),
            type(backend).__name__)


def test_standard_ops_on_cuda_tensors_use_nccl():
    ok_reduce, ok_gather, name = run_ranks(cuda_ops_worker, 1)[0]
    assert ok_reduce and ok_gather
    assert name == "ProcessGroupTide"
