"""The paper's three workloads as trainable modules, from the step-time model's shapes
(workloads.py): every FSDP unit's parameters have the shapes and order the model counts
(tests/python/test_bench_step.py checks this), so a measured step and its prediction are of
the same model. Built on the meta device; `init_weights` fills each rank's shards after
fully_shard, so the full model never exists on one rank (70B fits).

- Llama-3.1 (dense decoder): RMSNorm, RoPE, grouped-query attention, SwiGLU.
- Qwen3-30B-A3B (MoE decoder): per-head q/k RMSNorm, a softmax router picking the top-k of
  the experts (probabilities renormalised), experts stacked in three tensors; FSDP only, so
  every block all-gathers all its experts. The experts run one after another (a grouped
  GEMM where torch has one for the device is an optimisation the comparison does not need:
  stock and TIDE run the same compute).
- Wan2.2-like DiT: patch embedding, text and time embeddings, blocks of adaLN-modulated
  self-attention, cross-attention to the text and a GELU FFN; a flow-matching MSE loss
  against a random target.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models import RMSNorm, apply_rope, rope_tables

_ROPE: dict = {}


def _rope(head_dim: int, seq: int, device):
    """cos, sin for RoPE, made on first use (a buffer would be empty after meta init)."""
    key = (head_dim, seq, str(device))
    if key not in _ROPE:
        cos, sin = rope_tables(head_dim, seq, 500000.0)
        _ROPE[key] = (cos.to(device), sin.to(device))
    return _ROPE[key]


def _attention(q, k, v, causal: bool):
    # (batch, seq, heads, hd) -> (batch, seq, heads * hd); K/V heads shared (GQA)
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal)
    return out.transpose(1, 2).flatten(2)


class _Decoder(nn.Module):
    """Embedding, blocks, final norm and output head (the root unit: embed, norm, output)."""

    def __init__(self, shape: dict, block):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape["vocab"], shape["d"])
        self.layers = nn.ModuleList(block(shape) for _ in range(shape["layers"]))
        self.norm = RMSNorm(shape["d"], 1e-5)
        self.output = nn.Linear(shape["d"], shape["vocab"], bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        cos, sin = _rope(self.shape["hd"], tokens.shape[1], tokens.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, batch):
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def batch(self, tokens: int, seq: int, step: int, rank: int, device):
        """Learnable synthetic text (arithmetic progressions modulo the vocabulary), a new
        batch per step and rank: tokens // seq sequences of seq tokens."""
        g = torch.Generator().manual_seed(1000 * step + rank)
        rows = max(1, tokens // seq)
        start = torch.randint(0, self.shape["vocab"], (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        return ((start + stride * torch.arange(seq + 1)) % self.shape["vocab"]).to(device)


class _SelfAttention(nn.Module):
    def __init__(self, s: dict, qk_norm: bool):
        super().__init__()
        self.heads, self.kv, self.hd = s["heads"], s["kv"], s["hd"]
        self.wq = nn.Linear(s["d"], s["heads"] * s["hd"], bias=False)
        self.wk = nn.Linear(s["d"], s["kv"] * s["hd"], bias=False)
        self.wv = nn.Linear(s["d"], s["kv"] * s["hd"], bias=False)
        self.wo = nn.Linear(s["heads"] * s["hd"], s["d"], bias=False)
        self.q_norm = RMSNorm(s["hd"], 1e-6) if qk_norm else None
        self.k_norm = RMSNorm(s["hd"], 1e-6) if qk_norm else None

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.heads, self.hd)
        k = self.wk(x).view(b, n, self.kv, self.hd)
        v = self.wv(x).view(b, n, self.kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.wo(_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, causal=True))


class LlamaBlock(nn.Module):
    # Parameter order as workloads.llama31_70b: wq, wk, wv, wo, w1, w3, w2, the two norms.
    def __init__(self, s: dict):
        super().__init__()
        self.attn = _SelfAttention(s, qk_norm=False)
        self.w1 = nn.Linear(s["d"], s["ffn"], bias=False)  # gate
        self.w3 = nn.Linear(s["d"], s["ffn"], bias=False)  # up
        self.w2 = nn.Linear(s["ffn"], s["d"], bias=False)  # down
        self.attn_norm = RMSNorm(s["d"], 1e-5)
        self.ffn_norm = RMSNorm(s["d"], 1e-5)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Weight(nn.Module):
    """One parameter in a module of its own, so it takes its place in the parameter order
    (a module lists its own parameters before its children's)."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _Experts(nn.Module):
    def __init__(self, e: int, d: int, f: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(e, f, d))
        self.up = nn.Parameter(torch.empty(e, f, d))
        self.down = nn.Parameter(torch.empty(e, d, f))


class MoEBlock(nn.Module):
    # Parameter order as workloads.qwen3_30b_a3b: wq, wk, wv, wo, q/k norms, router, the
    # stacked gate / up / down experts, the two norms.
    def __init__(self, s: dict):
        super().__init__()
        self.attn = _SelfAttention(s, qk_norm=True)
        e, d, f = s["experts"], s["d"], s["effn"]
        self.topk = s["topk"]
        self.router = nn.Linear(d, e, bias=False)
        self.experts = _Experts(e, d, f)
        self.attn_norm = RMSNorm(d, 1e-6)
        self.ffn_norm = RMSNorm(d, 1e-6)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x).flatten(0, 1)
        probs = self.router(h).float().softmax(-1)
        weight, expert = probs.topk(self.topk, dim=-1)
        weight = (weight / weight.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        ex = self.experts
        for e in range(ex.gate.shape[0]):
            rows, slot = (expert == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            he = h[rows]
            y = (F.silu(he @ ex.gate[e].t()) * (he @ ex.up[e].t())) @ ex.down[e].t()
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return x + out.view_as(x)


def llama(shape: dict) -> nn.Module:
    return _Decoder(shape, LlamaBlock)


def qwen3_moe(shape: dict) -> nn.Module:
    return _Decoder(shape, MoEBlock)


class _DitAttention(nn.Module):
    # q, k, v, o with biases, then RMSNorm on q and k over the width (Wan's norm_q, norm_k).
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q = RMSNorm(d, 1e-6)
        self.norm_k = RMSNorm(d, 1e-6)

    def forward(self, x, context):
        b, n, d = x.shape
        q = self.norm_q(self.q(x)).view(b, n, self.heads, -1)
        k = self.norm_k(self.k(context)).view(b, context.shape[1], self.heads, -1)
        v = self.v(context).view(b, context.shape[1], self.heads, -1)
        return self.o(_attention(q, k, v, causal=False))


def _modulate(x, shift, scale):
    return F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift


class DitBlock(nn.Module):
    # Parameter order as workloads.wan22_14b: self-attention, cross-attention, FFN, norm3's
    # weight and bias, the adaLN modulation.
    def __init__(self, s: dict):
        super().__init__()
        d = s["d"]
        self.self_attn = _DitAttention(d, s["heads"])
        self.cross_attn = _DitAttention(d, s["heads"])
        self.ffn_in = nn.Linear(d, s["ffn"])
        self.ffn_out = nn.Linear(s["ffn"], d)
        self.norm3 = nn.LayerNorm(d)
        self.modulation = _Weight(1, 6, d)

    def forward(self, x, e0, context):
        shift, scale, gate, shift2, scale2, gate2 = (self.modulation.weight + e0).chunk(6, dim=1)
        h = _modulate(x, shift, scale)
        x = x + self.self_attn(h, h) * gate
        x = x + self.cross_attn(self.norm3(x), context)
        return x + self.ffn_out(F.gelu(self.ffn_in(_modulate(x, shift2, scale2)), approximate="tanh")) * gate2


class WanDit(nn.Module):
    """Root unit: patch, text and time embeddings, time projection, head modulation, head."""

    def __init__(self, s: dict, text_tokens: int = 512):
        super().__init__()
        self.shape, self.text_tokens = s, text_tokens
        d, ch = s["d"], s["channels"]
        self.patch_embedding = nn.Conv3d(ch, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = nn.Sequential(nn.Linear(s["text_dim"], d), nn.GELU(approximate="tanh"),
                                            nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(s["freq_dim"], d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.layers = nn.ModuleList(DitBlock(s) for _ in range(s["layers"]))
        self.head_modulation = _Weight(1, 2, d)
        self.head = nn.Linear(d, ch * 4)

    def forward(self, latent, context, timestep):
        x = self.patch_embedding(latent).flatten(2).transpose(1, 2)  # (batch, tokens, d)
        half = self.shape["freq_dim"] // 2
        freqs = torch.exp(-torch.arange(half, device=x.device, dtype=torch.float32) * (9.210340371976184 / half))
        angles = timestep.float()[:, None] * freqs[None]
        t = torch.cat([angles.cos(), angles.sin()], dim=1).to(x.dtype)
        e = self.time_embedding(t)
        e0 = self.time_projection(e).unflatten(1, (6, -1))
        context = self.text_embedding(context)
        for layer in self.layers:
            x = layer(x, e0, context)
        shift, scale = (self.head_modulation.weight + e[:, None]).chunk(2, dim=1)
        return self.head(_modulate(x, shift, scale))

    def loss(self, batch):
        latent, context, timestep, target = batch
        return F.mse_loss(self(latent, context, timestep).float(), target)

    def batch(self, tokens: int, seq: int, step: int, rank: int, device):
        """One clip of `tokens` latent patches (1 x 2 x 2 each), its text and timestep, and a
        random flow-matching target; `seq` is unused (a clip attends over all its tokens)."""
        g = torch.Generator().manual_seed(1000 * step + rank)
        s = self.shape
        latent = torch.randn(1, s["channels"], 1, 2, 2 * tokens, generator=g)
        context = torch.randn(1, self.text_tokens, s["text_dim"], generator=g)
        timestep = torch.randint(0, 1000, (1,), generator=g)
        target = torch.randn(1, tokens, s["channels"] * 4, generator=g)
        return tuple(x.to(device) for x in (latent, context, timestep, target))


def wan_dit(shape: dict, text_tokens: int = 512) -> nn.Module:
    return WanDit(shape, text_tokens)


BUILDERS = {"llama3.1-70b": llama, "qwen3-30b-a3b": qwen3_moe, "wan2.2-14b": wan_dit}


@torch.no_grad()
def init_weights(model: nn.Module, rank: int, seed: int = 0):
    """Fills every rank's shards after fully_shard and to_empty: norms' weights 1, every
    other parameter N(0, 0.02) from a generator on the shard's device seeded by (seed, its
    name without the activation checkpointing wrapper's part, the rank), so runs of the same
    model at the same world size on the same device start from the same weights whatever the
    backend, without the full model on any rank."""
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        name = name.replace("_checkpoint_wrapped_module.", "")
        if "norm" in name and name.endswith("weight"):
            local.fill_(1.0)
            continue
        g = torch.Generator(device=local.device)
        g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * rank)
        local.normal_(0.0, 0.02, generator=g)
