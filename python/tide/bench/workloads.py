"""Workloads for the step-time model: layer shapes, FSDP units, FLOPs, activations.

Every FSDP unit is one transformer block (fully_shard per block, as torchtitan and the FSDP2
docs do), plus the root unit (embeddings, final norm, output head). Parameters are listed as
the shapes fully_shard sees, so the byte counts match the planner's (tide._C.plan).

FLOPs: a GEMM (M x K) @ (K x N) is 2*M*N*K forward and 4*M*N*K backward (input and weight
gradients). Attention (flash) is 4*s*s*h_dim*heads forward per sequence (QK^T and PV), half
of that when causal, and 2.5x forward in backward (FlashAttention-2 paper's accounting:
backward = 5 matmuls vs 2). With activation checkpointing per block the forward runs twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gemm:
    m: int  # tokens (rows of the activation)
    n: int  # output features
    k: int  # input features
    count: int = 1  # identical GEMMs (e.g. experts)
    grouped: bool = False  # the `count` GEMMs run as one grouped kernel (MoE experts)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass
class Unit:
    name: str
    params: list  # list of shapes (tuples), as fully_shard sees them
    gemms: list = field(default_factory=list)  # forward GEMMs of the unit
    attn_flops: float = 0.0  # forward attention FLOPs (flash)
    act_bytes: float = 0.0  # activations one block keeps for backward (no checkpointing)
    ckpt_bytes: float = 0.0  # what it keeps with activation checkpointing (block input)

    @property
    def numel(self) -> int:
        n = 0
        for s in self.params:
            p = 1
            for d in s:
                p *= d
            n += p
        return n

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)


@dataclass
class Workload:
    name: str
    source: str
    tokens_per_gpu: int
    units: list  # forward order: root first, then blocks
    activation_checkpointing: bool = True
    notes: str = ""

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def blocks(self) -> list:
        return self.units[1:]

    @property
    def root(self) -> Unit:
        return self.units[0]


def _act_bytes(tokens: int, d: int) -> float:
    # Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
    # (2022): a block keeps s*b*h*(34 + 5*a*s/h) bytes in 16-bit training; flash attention
    # drops the 5*a*s/h term (no attention matrix), leaving 34 bytes per token per hidden unit.
    return 34.0 * tokens * d


# The published shapes. meta-llama/Llama-3.1-70B config.json: hidden_size 8192,
# intermediate_size 28672, num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8,
# vocab_size 128256, tie_word_embeddings false (Llama 3 paper, Dubey et al., 2024, Table 3).
LLAMA31_70B = dict(d=8192, ffn=28672, layers=80, heads=64, kv=8, hd=128, vocab=128256)
# Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48,
# num_attention_heads 32, num_key_value_heads 4, head_dim 128, num_experts 128,
# num_experts_per_tok 8, moe_intermediate_size 768, vocab_size 151936,
# tie_word_embeddings false, q/k RMSNorm per head.
QWEN3_30B_A3B = dict(d=2048, layers=48, heads=32, kv=4, hd=128, experts=128, topk=8, effn=768,
                     vocab=151936)
# Wan2.2 T2V-A14B (Wan-AI/Wan2.2-T2V-A14B, each expert a 14B DiT; the Wan 2.1/2.2 report
# "Wan: Open and Advanced Large-Scale Video Generative Models", 2025, Table of 14B config):
# dim 5120, ffn_dim 13824, 40 layers, 40 heads, text_dim 4096 (umT5), text_len 512,
# freq_dim 256, patch (1, 2, 2), VAE stride (4, 8, 8), in/out channels 16.
WAN22_14B = dict(d=5120, ffn=13824, layers=40, heads=40, hd=128, text_dim=4096, freq_dim=256,
                 channels=16)
# The widths a hidden divisor K divides (the head dimension, expert count and top-k,
# frequency and latent channels stay); heads become the new width over the head dimension.
_WIDTHS = ("d", "ffn", "vocab", "effn", "text_dim")


def scaled(shape: dict, layers: int | None = None, divisor: int = 1) -> dict:
    """`shape` with `layers` blocks and its widths divided by `divisor` (the head dimension
    kept, so heads are divided; KV heads at least 1): the paper's models fitted to a smaller
    cluster or to a CPU, with the same kinds of parameters in the same proportions."""
    out = dict(shape)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        out["layers"] = layers
    if divisor < 1 or shape["heads"] % divisor:
        ok = [k for k in range(1, shape["heads"] + 1) if shape["heads"] % k == 0]
        raise ValueError(f"hidden divisor {divisor} must divide the {shape['heads']} attention heads "
                         f"(the head dimension {shape['hd']} is kept): one of {ok}")
    for key in _WIDTHS:
        if key in out:
            out[key] = max(1, out[key] // divisor)
    out["heads"] = shape["heads"] // divisor
    if "kv" in out:
        out["kv"] = max(1, shape["kv"] // divisor)
    if "d" in out and out["d"] % out["heads"]:
        raise ValueError(f"hidden divisor {divisor}: width {out['d']} is not a multiple of {out['heads']} heads")
    return out


def llama31_70b(tokens_per_gpu: int = 8192, seq_len: int = 8192, shape: dict = LLAMA31_70B) -> Workload:
    d, ffn, layers, heads, kv, vocab = (shape[k] for k in ("d", "ffn", "layers", "heads", "kv", "vocab"))
    hd = shape["hd"]
    t = tokens_per_gpu
    seqs = max(1, t // seq_len)
    blocks = []
    for i in range(layers):
        params = [(heads * hd, d), (kv * hd, d), (kv * hd, d), (d, heads * hd),
                  (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]
        gemms = [Gemm(t, heads * hd, d), Gemm(t, kv * hd, d, 2), Gemm(t, d, heads * hd),
                 Gemm(t, ffn, d, 2), Gemm(t, d, ffn)]
        attn = 0.5 * 4.0 * seq_len * seq_len * hd * heads * seqs  # causal
        blocks.append(Unit(f"layers.{i}", params, gemms, attn, _act_bytes(t, d), 2.0 * t * d))
    root = Unit("root", [(vocab, d), (d,), (vocab, d)], [Gemm(t, vocab, d)], 0.0,
                act_bytes=t * vocab * 4.0, ckpt_bytes=0.0)  # fp32 logits for the loss
    return Workload(_name("llama3.1-70b", shape, LLAMA31_70B), "meta-llama/Llama-3.1-70B config.json", t,
                    [root] + blocks,
                    notes=f"{t} tokens/GPU, sequence {seq_len}, causal")


def wan22_14b(tokens_per_gpu: int = 32760, text_tokens: int = 512, shape: dict = WAN22_14B) -> Workload:
    # Block: self-attention (q, k, v, o: d x d, RMSNorm on q and k), cross-attention to the
    # text (q, k, v, o: d x d; text embedded to d by text_embedding first), GELU FFN
    # (d -> ffn -> d, no gate), adaLN modulation (6 x d per block), norms.
    # Tokens per GPU (assumption, the paper does not say): one 81-frame 480x832 clip per GPU:
    # latent 21 x 60 x 104 (VAE 4x8x8, 1 + 80/4 frames), patchified 1x2x2 -> 21*30*52 = 32760.
    d, ffn, layers, heads, hd = (shape[k] for k in ("d", "ffn", "layers", "heads", "hd"))
    text_dim, freq, ch = shape["text_dim"], shape["freq_dim"], shape["channels"]
    t, txt = tokens_per_gpu, text_tokens
    blocks = []
    for i in range(layers):
        params = [(d, d), (d,), (d, d), (d,), (d, d), (d,), (d, d), (d,), (d,), (d,),  # self
                  (d, d), (d,), (d, d), (d,), (d, d), (d,), (d, d), (d,), (d,), (d,),  # cross
                  (ffn, d), (ffn,), (d, ffn), (d,),  # ffn
                  (d,), (d,), (1, 6, d)]  # norm3 affine, modulation
        gemms = [Gemm(t, d, d, 4),  # self-attention projections
                 Gemm(t, d, d, 2), Gemm(txt, d, d, 2),  # cross: q, o on video; k, v on text
                 Gemm(t, ffn, d), Gemm(t, d, ffn)]
        attn = 4.0 * t * t * hd * heads + 4.0 * t * txt * hd * heads  # bidirectional + cross
        blocks.append(Unit(f"blocks.{i}", params, gemms, attn, _act_bytes(t, d), 2.0 * t * d))
    root_params = [(d, ch, 1, 2, 2), (d,),  # patch embedding (Conv3d)
                   (d, text_dim), (d,), (d, d), (d,),  # text embedding MLP
                   (d, freq), (d,), (d, d), (d,),  # time embedding
                   (6 * d, d), (6 * d,),  # time projection
                   (1, 2, d), (ch * 4, d), (ch * 4,)]  # head modulation + output head
    root = Unit("root", root_params, [Gemm(txt, d, text_dim), Gemm(txt, d, d), Gemm(t, ch * 4, d)],
                0.0, act_bytes=0.0)
    return Workload(_name("wan2.2-14b", shape, WAN22_14B), "Wan-AI/Wan2.2-T2V-A14B config.json", t, [root] + blocks,
                    notes=f"{t} video tokens/GPU (81 frames 480x832, assumption), {txt} text tokens")


def qwen3_30b_a3b(tokens_per_gpu: int = 8192, seq_len: int = 8192, shape: dict = QWEN3_30B_A3B) -> Workload:
    # FSDP only (no expert parallelism): every block all-gathers all its experts.
    d, layers, heads, kv, hd, E, topk, effn, vocab = (
        shape[k] for k in ("d", "layers", "heads", "kv", "hd", "experts", "topk", "effn", "vocab"))
    t = tokens_per_gpu
    seqs = max(1, t // seq_len)
    per_expert = t * topk // E  # tokens per expert with a perfectly balanced router
    blocks = []
    for i in range(layers):
        params = [(heads * hd, d), (kv * hd, d), (kv * hd, d), (d, heads * hd), (hd,), (hd,),
                  (E, d),  # router
                  (E, effn, d), (E, effn, d), (E, d, effn),  # experts (gate, up, down) stacked
                  (d,), (d,)]
        gemms = [Gemm(t, heads * hd, d), Gemm(t, kv * hd, d, 2), Gemm(t, d, heads * hd),
                 Gemm(t, E, d),
                 Gemm(per_expert, effn, d, 2 * E, True), Gemm(per_expert, d, effn, E, True)]
        attn = 0.5 * 4.0 * seq_len * seq_len * hd * heads * seqs
        # Attention part as a dense block, plus the routed experts' gate/up/activation/output
        # (3 * effn + d values per token and expert, 2 bytes each).
        act = _act_bytes(t, d) + 2.0 * t * topk * (3 * effn + d)
        blocks.append(Unit(f"layers.{i}", params, gemms, attn, act, 2.0 * t * d))
    root = Unit("root", [(vocab, d), (d,), (vocab, d)], [Gemm(t, vocab, d)], 0.0,
                act_bytes=t * vocab * 4.0)
    return Workload(_name("qwen3-30b-a3b", shape, QWEN3_30B_A3B), "Qwen/Qwen3-30B-A3B config.json", t, [root] + blocks,
                    notes=f"{t} tokens/GPU, sequence {seq_len}, top-{topk} of {E} experts, balanced")


def _name(name: str, shape: dict, full: dict) -> str:
    """The workload's name, with how it was scaled where it was."""
    if shape == full:
        return name
    k = full["d"] // shape["d"]
    return f"{name} ({shape['layers']} layers" + (f", widths / {k}" if k > 1 else "") + ")"


WORKLOADS = {"llama3.1-70b": llama31_70b, "wan2.2-14b": wan22_14b, "qwen3-30b-a3b": qwen3_30b_a3b}
SHAPES = {"llama3.1-70b": LLAMA31_70B, "wan2.2-14b": WAN22_14B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def single_unit(numel_shapes: list, tokens: int, d: int) -> Workload:
    """A one-block workload of plain GEMMs (tests and hand checks)."""
    gemms = [Gemm(tokens, s[0], s[1]) for s in numel_shapes if len(s) == 2]
    u = Unit("block", list(numel_shapes), gemms, 0.0, _act_bytes(tokens, d), 2.0 * tokens * d)
    root = Unit("root", [], [], 0.0)
    return Workload("single", "test", tokens, [root, u])
