"""FSDP2 on real model code, as its users train it, on tide groups against stock FSDP2 on
gloo (an independent backend): HuggingFace transformers' Llama and Qwen2 built from configs,
one fully_shard per decoder layer then the root, tied and untied embeddings, gradient
checkpointing, AdamW, clip_grad_norm_, 3 steps, fp32 and bf16 mixed precision. Every test
checks on every rank that every param group took TIDE's path.

At 2 ranks the results are bitwise stock's (a + b does not depend on the order). At 3 and 4
ranks gloo adds the ranks in another order than TIDE's rank order: bitwise against stock
FSDP2 on gloo whose reduce-scatter adds in rank order (FSDP2's set_custom_reduce_scatter,
clipping off: gloo's all-reduce of the norms has its own order too), and within
ADAMW_SUM_ORDER_ATOL of plain stock FSDP2 on gloo."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from real_models import (ADAMW_LR, ADAMW_SUM_ORDER_ATOL, assert_params_equal, assert_tide_ran_everywhere,
                         full_params, hf_model, hf_step, shard_decoder, tide_paths)

pytest.importorskip("transformers", reason="transformers is a test dependency (scripts/requirements.txt)")

STEPS = 3


def hf_train_worker(rank, ws, family, tied=True, bf16=False, checkpointing=False, clip=1.0,
                    rank_order_rs=False, zero_copy=True):
    """Trains a transformers decoder under FSDP2 for STEPS steps; returns the losses, the
    full parameters and which path TIDE took."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide.fsdp

    if not zero_copy:
        tide.fsdp.uninstall()
    model = hf_model(family, tied, checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    shard_decoder(model, init_device_mesh("cpu", (ws,)), mp)
    if rank_order_rs:
        from test_pseudo_nodes import documented_order_reduce_scatter

        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(documented_order_reduce_scatter(ws))
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    losses = [hf_step(model, opt, step, rank, clip) for step in range(STEPS)]
    return dict(losses=losses, params=full_params(model), paths=tide_paths())


def _stock(ws, **kwargs):
    return run_ranks(hf_train_worker, ws, kwargs=dict(zero_copy=False, **kwargs), backend="gloo", timeout=300)


@pytest.mark.parametrize("family, tied, bf16, checkpointing", [
    ("llama", True, False, True), ("llama", False, True, True),
    ("qwen2", False, False, False), ("qwen2", True, True, False)])
def test_transformers_at_two_ranks_bitwise_equal_to_stock_fsdp2_on_gloo(family, tied, bf16, checkpointing):
    kwargs = dict(family=family, tied=tied, bf16=bf16, checkpointing=checkpointing)
    tide_run = run_ranks(hf_train_worker, 2, kwargs=kwargs, timeout=300)
    stock = _stock(2, **kwargs)
    # A decoder layer each, and the root (embeddings, final norm, head).
    assert_tide_ran_everywhere(tide_run, groups=3)
    for r in range(2):
        assert tide_run[r]["losses"] == stock[r]["losses"]
        assert_params_equal(tide_run[r]["params"], stock[r]["params"], f"{family} rank {r}")


@pytest.mark.parametrize("ws, family, bf16", [(3, "qwen2", True), (4, "llama", False)])
def test_transformers_at_three_and_four_ranks(ws, family, bf16):
    kwargs = dict(family=family, tied=True, bf16=bf16, checkpointing=True)
    # Bitwise, against a stock reduce-scatter that adds in TIDE's documented order.
    tide_run = run_ranks(hf_train_worker, ws, kwargs=dict(clip=None, **kwargs), timeout=300)
    ordered = _stock(ws, clip=None, rank_order_rs=True, **kwargs)
    assert_tide_ran_everywhere(tide_run, groups=3)
    for r in range(ws):
        assert tide_run[r]["losses"] == ordered[r]["losses"]
        assert_params_equal(tide_run[r]["params"], ordered[r]["params"], f"ws {ws} rank {r}, rank-order reference")
    # Within the sum-order tolerance of plain stock FSDP2 on gloo, clipping on.
    tide_clipped = run_ranks(hf_train_worker, ws, kwargs=kwargs, timeout=300)
    stock = _stock(ws, **kwargs)
    assert_tide_ran_everywhere(tide_clipped, groups=3)
    for r in range(ws):
        assert max(abs(a - b) for a, b in zip(tide_clipped[r]["losses"], stock[r]["losses"])) < 1e-5
        assert_params_equal(tide_clipped[r]["params"], stock[r]["params"], f"ws {ws} rank {r}",
                            atol=ADAMW_SUM_ORDER_ATOL)
