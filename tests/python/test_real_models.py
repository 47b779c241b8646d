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


# ---- LoRA / frozen bases (peft) ------------------------------------------------------------------
def lora_worker(rank, ws, base_dtype, zero_copy=True):
    """peft's LoRA on the transformers Llama: the base frozen in `base_dtype`, the adapters
    trainable in fp32, in the same param groups (one fully_shard per decoder layer)."""
    import warnings

    import peft
    from torch.distributed.device_mesh import init_device_mesh

    import tide.fsdp

    if not zero_copy:
        tide.fsdp.uninstall()
    model = hf_model("llama", tied=False).to(base_dtype)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                       init_lora_weights=False))
    for n, p in model.named_parameters():  # the adapters in fp32 beside the base
        if "lora_" in n:
            p.data = p.data.float()
    shard_decoder(model.base_model.model, init_device_mesh("cpu", (ws,)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ADAMW_LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [hf_step(model, opt, step, rank, clip=None) for step in range(STEPS)]
    return dict(losses=losses, params=full_params(model), paths=tide_paths(),
                warnings=sorted({str(w.message) for w in caught if str(w.message).startswith("tide:")}),
                dtypes=sorted({str(p.dtype) for p in model.parameters()}))


@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float32], ids=["bf16-base", "fp32-base"])
def test_lora_adapters_beside_a_frozen_base(base_dtype):
    """A group of mixed dtypes (bf16 base, fp32 adapters) is all-gathered zero-copy, one
    TIDE-AG per dtype; the reduce-scatter carries the adapters' gradients only."""
    tide_run = run_ranks(lora_worker, 2, base_dtype, timeout=300)
    stock = run_ranks(lora_worker, 2, base_dtype, kwargs=dict(zero_copy=False), backend="gloo", timeout=300)
    want = {"torch.float32"} | {str(base_dtype)}
    for r in range(2):
        assert set(tide_run[r]["dtypes"]) == want, tide_run[r]["dtypes"]
        assert not tide_run[r]["warnings"], tide_run[r]["warnings"]
        assert tide_run[r]["losses"] == stock[r]["losses"]
        assert_params_equal(tide_run[r]["params"], stock[r]["params"], f"LoRA rank {r}")
    # The root's group (embeddings, norm, head) is frozen: it gathers, never reduces.
    for r, res in enumerate(tide_run):
        stats, by_group = res["paths"]["stats"], res["paths"]["by_group"]
        assert stats["stock_all_gather"] == 0 and stats["stock_reduce_scatter"] == 0, (r, stats)
        assert len(by_group) == 3 and all(c["zero_copy_all_gather"] > 0 for c in by_group.values()), by_group
        assert sum(c["zero_copy_reduce_scatter"] > 0 for c in by_group.values()) == 2, by_group
