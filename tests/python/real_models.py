"""What the tests of FSDP2 as users run it share: small randomly initialised HuggingFace
models built from configs (no downloaded weights), a training loop with AdamW and clipping,
and the check that TIDE's path ran on every rank for every param group."""
from __future__ import annotations

import torch

# Odd vocabulary and FFN widths: uneven shards and padding at every world size.
HF_SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# AdamW moves every parameter by about lr a step whatever its gradient's size, so two runs
# whose gradients differ only in the last bits (fp32 sums in another order: gloo's
# reduce-scatter and all-reduce do not add ranks in rank order at 3 or more ranks) can move a
# near-zero gradient's parameter differently; 1e-4 is a tenth of a step of lr 1e-3 (seen:
# at most 2e-5 after 3 steps), while a wrong or missing contribution moves most parameters
# by a whole step.
ADAMW_LR = 1e-3
ADAMW_SUM_ORDER_ATOL = 1e-4


def hf_model(family: str, tied: bool, checkpointing: bool = False, meta: bool = False, layers: int | None = None):
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    cfg = cfg_cls(tie_word_embeddings=tied, **{**HF_SHAPE, **({} if layers is None else dict(num_hidden_layers=layers))})
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = model_cls(cfg)
    else:
        model = model_cls(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def hf_batch(step: int, rank: int, vocab: int = HF_SHAPE["vocab_size"]):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, 24), generator=g)


def hf_step(model, opt, step, rank, clip=1.0):
    ids = hf_batch(step, rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return loss.item()


def shard_decoder(model, mesh, mp=None, **kwargs):
    """FSDP2 as users apply it to a transformers decoder: each layer, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = mp or MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **kwargs)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kwargs)
    return model


def full_params(model):
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def tide_paths():
    """This rank's record of which path each param group's collectives took."""
    import tide.fsdp

    return dict(stats=dict(tide.fsdp.stats),
                by_group={k: dict(v) for k, v in tide.fsdp.stats_by_group.items()})


def assert_tide_ran_everywhere(results, groups=None, reduce_scatter=True):
    """On every rank, every param group's collectives took TIDE's path (stock count zero),
    and, where `groups` is given, exactly that many param groups ran."""
    for rank, res in enumerate(results):
        stats, by_group = res["paths"]["stats"], res["paths"]["by_group"]
        assert stats["stock_all_gather"] == 0 and stats["stock_reduce_scatter"] == 0, (rank, stats)
        assert stats["zero_copy_all_gather"] > 0, (rank, stats)
        if reduce_scatter:
            assert stats["zero_copy_reduce_scatter"] > 0, (rank, stats)
        if groups is not None:
            assert len(by_group) == groups, (rank, sorted(by_group))
        for name, counts in by_group.items():
            assert counts["zero_copy_all_gather"] > 0, (rank, name, counts)
            if reduce_scatter:
                assert counts["zero_copy_reduce_scatter"] > 0, (rank, name, counts)


def assert_params_equal(a, b, what, atol=0.0):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for n in a:
        if atol == 0.0:
            assert torch.equal(a[n], b[n]), f"{what}: {n} differs by {(a[n].double() - b[n].double()).abs().max()}"
        else:
            diff = (a[n].double() - b[n].double()).abs().max().item()
            assert diff <= atol, f"{what}: {n} differs by {diff} > {atol}"
