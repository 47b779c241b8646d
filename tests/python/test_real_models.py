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


@pytest.mark.one_torch
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


# ---- torchtitan's FSDP recipe ----------------------------------------------------------------------
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


class CausalSdpa(torch.nn.Module):
    """What replaces torchtitan's inner attention kernel on CPU, and nothing else: its
    language models take flex or varlen attention only, and flex attention has no backward on
    CPU. The same causal attention, through torch's scaled_dot_product_attention, on the
    (batch, seq, heads, head_dim) tensors torchtitan's attention module hands its kernel."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def titan_worker(rank, ws, weight_tying, bf16, zero_copy=True):
    """torchtitan's Llama3 debug model (6 layers, dim 256, vocab 2048) on the meta device,
    torchtitan's apply_fsdp_to_decoder (per-block fully_shard, its reshard-after-forward
    policy and mixed-precision policy; the embeddings, norm and head as one fully_shard on a
    list where weights are tied), materialised with to_empty and torchtitan's own init."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.llama3 import model_registry

    import tide.fsdp

    if not zero_copy:
        tide.fsdp.uninstall()
    config = model_registry("debugmodel", attn_backend="flex").model
    if weight_tying:
        config = dataclasses.replace(config, enable_weight_tying=True)
    with torch.device("meta"):
        model = config.build()
    for block in model.layers.values():
        block.attention.inner_attention = CausalSdpa()
    apply_fsdp_to_decoder(model, init_device_mesh("cpu", (ws,)),
                          param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)
    if not zero_copy:
        # The gloo reference's one change: torchtitan turns FSDP2's gradient division off
        # (factor 1.0, a PREMUL_SUM that NCCL and tide run and gloo refuses); FSDP2's
        # force-sum mode sums and divides by 1.0 instead, bit for bit the same sums.
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 2048, (2, 33), generator=g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, params=full_params(model), paths=tide_paths())


@pytest.mark.skipif(TORCH < (2, 15), reason="torchtitan 0.3.0 imports FSDP2's DataParallelMeshDims (torch 2.15)")
@pytest.mark.parametrize("weight_tying, bf16", [(False, True), (True, False)], ids=["bf16", "tied-fp32"])
def test_torchtitan_fsdp_recipe_on_its_llama3_debug_model(weight_tying, bf16):
    tide_run = run_ranks(titan_worker, 2, weight_tying, bf16, timeout=600)
    stock = run_ranks(titan_worker, 2, weight_tying, bf16, kwargs=dict(zero_copy=False), backend="gloo",
                      timeout=600)
    # 6 blocks, and the embeddings and head: apart (2 groups) or tied (1 list group).
    assert_tide_ran_everywhere(tide_run, groups=7 if weight_tying else 8)
    for r in range(2):
        assert tide_run[r]["losses"] == stock[r]["losses"]
        assert_params_equal(tide_run[r]["params"], stock[r]["params"], f"torchtitan rank {r}")
