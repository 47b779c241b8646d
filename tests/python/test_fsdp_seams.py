"""The details of FSDP2's seams that TIDE replaces, against stock FSDP2 on the same tide
group (tide.fsdp.uninstall()): gradients under create_graph=True, post-accumulate-grad hooks
run as often as stock runs them, and a parameter's grad_dtype (torch 2.15) gives its gradient
that dtype. (Under compiled autograd, 2.11-2.12 keep their stock path: _gen_2_11.py.)"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from test_fsdp_zero_copy import AwkwardModel, batch, loss_of


def seam_worker(rank, ws, zero_copy, create_graph=False, grad_dtype=False):
    import torch.distributed as dist  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import tide.fsdp

    if not zero_copy:
        tide.fsdp.uninstall()
    torch.manual_seed(0)
    model = AwkwardModel()
    if grad_dtype:  # one parameter keeps bf16 gradients (torch 2.15's grad_dtype policy)
        model.score.weight.grad_dtype = torch.bfloat16
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.llama.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    hooks = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: hooks.__setitem__(name, hooks.get(name, 0) + 1))
    for step in range(2):
        loss = loss_of(model, batch(step, rank))
        loss.backward(create_graph=create_graph)
        grads = {n: (p.grad.dtype, p.grad.requires_grad, p.grad.grad_fn is not None,
                     p.grad.full_tensor().detach().clone())
                 for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
    return dict(grads=grads, hooks=hooks, stats=dict(tide.fsdp.stats))


def compare(zc, stock, what):
    assert zc["stats"]["zero_copy_reduce_scatter"] > 0, f"{what}: the zero-copy path did not run"
    assert zc["stats"]["stock_reduce_scatter"] == 0, f"{what}: a stock reduce-scatter ran: {zc['stats']}"
    for n, (dtype, req, fn, g) in stock["grads"].items():
        zd, zreq, zfn, zg = zc["grads"][n]
        assert (zd, zreq, zfn) == (dtype, req, fn), f"{what}: {n}: tide {(zd, zreq, zfn)}, stock {(dtype, req, fn)}"
        assert torch.equal(zg, g), f"{what}: {n}: gradients differ by {(zg.double() - g.double()).abs().max()}"
    assert zc["hooks"] == stock["hooks"], f"{what}: hooks ran {zc['hooks']} vs stock {stock['hooks']}"


def test_backward_with_create_graph_builds_no_graph_through_the_collectives():
    """With create_graph=True, grad mode is on during backward. Stock's seams run under
    torch.no_grad(), and so do TIDE's; the sharded gradients must come out as stock's do
    (no grad_fn, same values). FSDP2 detaches the gradients it hands the seams, so this
    compares outcomes rather than catching a missing no_grad on its own."""
    zc = run_ranks(seam_worker, 2, True, True)
    stock = run_ranks(seam_worker, 2, False, True)
    for r in range(2):
        compare(zc[r], stock[r], f"rank {r} create_graph")


def test_post_accumulate_grad_hooks_run_as_in_stock():
    zc = run_ranks(seam_worker, 2, True)
    stock = run_ranks(seam_worker, 2, False)
    assert stock[0]["hooks"], "stock ran no post-accumulate-grad hook: the test sees nothing"
    for r in range(2):
        compare(zc[r], stock[r], f"rank {r}")


def fsdp2_honours_grad_dtype():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return "sharded_grad_dtype" in getattr(FSDPParam, "__annotations__", {})


@pytest.mark.skipif(not fsdp2_honours_grad_dtype(), reason="this torch's FSDP2 has no per-parameter grad_dtype")
def test_a_parameters_grad_dtype_is_honoured():
    zc = run_ranks(seam_worker, 2, True, False, True)
    stock = run_ranks(seam_worker, 2, False, False, True)
    assert stock[0]["grads"]["score.weight"][0] == torch.bfloat16, stock[0]["grads"]["score.weight"][0]
    for r in range(2):
        compare(zc[r], stock[r], f"rank {r} grad_dtype")
