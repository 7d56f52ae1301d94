"""Llama-family architecture only (Llama 2/3/3.1, Mistral, Qwen2): RMSNorm, rotary positions,
SwiGLU MLP, grouped-query attention, optional q/k/v bias, tied or untied embeddings.

Owns: the modules, their parameter names, initialization, the forward pass and the FLOP estimate.
Like gpt2/model.py it must never import distributed, checkpoint, data or loss code: layouts are applied
from outside (hpctrain.parallel), Hugging Face names are mapped in hf.py.

Kept the same as gpt2/model.py so every layout works unchanged: the attributes tok_emb, pos_emb (None
here: positions are rotary), drop, blocks (a ModuleDict "0".."L-1"), norm_f and lm_head; blocks
with norm1 / attn.{wq,wk,wv,wo} / norm2 / mlp; a pipeline stage is this module with pieces set to
None. The MLP is mlp.gate, mlp.up (column-parallel) and mlp.proj (row-parallel, the residual one).

Numerics follow transformers' LlamaForCausalLM exactly (logits max |d| <= 1e-4 fp32, tested in
tests/unit/test_llama.py): RMSNorm in fp32 then cast back before the weight, rotary cos/sin in fp32
from inv_freq (Llama-3.1 "llama3" frequency scaling optional) with HF's rotate_half layout, so HF
q/k weights load without a permutation. cos/sin are computed in each attention call from the
sequence length (no buffers: meta-device init replays only parameter initialization).
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.attention import causal_attention, rope_angles
from hpctrain.model.gpt2.model import GPT, Block
from hpctrain.model.llama.args import llama_ffn_hidden
from hpctrain.model.moe_args import moe_config_kwargs
from hpctrain.model.moe import MoEConfig, MoEFeedForward


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    dropout: float = 0.0
    max_positions: int = 0          # what export writes as max_position_embeddings (0: block_size)
    n_kv_head: int = 0              # 0: n_head (multi-head attention)
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0  # 0: off; > 0: Llama-3.1 "llama3" frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    ffn_hidden: int = 0             # 0: Llama's rule (ffn_hidden_size)
    multiple_of: int = 256
    ffn_dim_multiplier: float = 1.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    moe: MoEConfig | None = None    # mixture-of-experts feed-forward in the sparse layers (moe.py)
    moe_every: int = 1              # layer i is sparse when (i + 1) % moe_every == 0 (Qwen2-MoE's
    moe_first_dense: int = 0        # decoder_sparse_step) and i >= moe_first_dense (DeepSeek's)

    def is_sparse(self, layer: int) -> bool:
        return (self.moe is not None and layer >= self.moe_first_dense
                and (layer + 1) % self.moe_every == 0)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_hidden_size(self) -> int:
        """ffn_hidden, or Llama's rule (args.llama_ffn_hidden, also checked against tp)."""
        return llama_ffn_hidden(self.n_embd, self.ffn_hidden, self.multiple_of, self.ffn_dim_multiplier)


def rope_inv_freq(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32 (HF's default and "llama3" rope_type)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device)
                                         .float() / d))
    if cfg.rope_scaling_factor <= 0:
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_positions
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(cfg: LlamaConfig, t: int, device, dtype,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, head_dim] for positions 0..t-1 (or [B, 1, T, head_dim] for ``positions``
    [B, T]), computed in fp32, returned in `dtype`."""
    emb = rope_angles(rope_inv_freq(cfg, device), t, positions)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg, self.head_dim = cfg, cfg.head_dim
        kv = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout
        self.attend = causal_attention  # the attention kernel; parallel/ may swap it (context parallelism)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; doc_ids / positions [B, T]: see GPT.forward."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp and n_kv_head / tp heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(self.cfg, t, q.device, q.dtype, positions)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = self.attend(q, k, v, doc_ids, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.wo(y))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = cfg.ffn_hidden_size
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.silu(self.gate(x)) * self.up(x)))


class LlamaBlock(Block):
    """GPT's pre-norm residual block (its forward) with llama's pieces."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        nn.Module.__init__(self)
        self.norm1 = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = (MoEFeedForward(cfg.n_embd, cfg.ffn_hidden_size, cfg.moe) if cfg.is_sparse(layer)
                    else SwiGLU(cfg))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = None  # rotary positions, inside attention
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg, i) for i in range(cfg.n_layer)})
        self.norm_f = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    reset_parameters = GPT.reset_parameters  # N(0, 0.02), wo / mlp.proj by 1/sqrt(2L), norms 1
    generate = GPT.generate

    forward = GPT.forward  # embed -> blocks -> norm_f -> lm_head; a pipeline stage: pieces None

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> the first block's input (positions are rotary, inside attention)."""
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.cfg.block_size}")
        return self.drop(self.tok_emb(idx))

    def num_params(self, non_embedding: bool = True) -> int:
        """Every parameter (a tied weight once); non_embedding: without the input embedding table
        when it is not the head's weight (a lookup, no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def active_params(self) -> int:
        """num_params() with each sparse layer's routed experts counted top_k / n_experts: the
        parameters one token's matmuls use (the MFU's N; equal to num_params() when dense)."""
        n = self.num_params()
        for block in self.blocks.values():
            if isinstance(block.mlp, MoEFeedForward):
                m = block.mlp.cfg
                n -= sum(p.numel() for p in block.mlp.experts.parameters()) * (m.n_experts - m.top_k) // m.n_experts
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls (the head included; N = the active
        parameters under MoE) plus attention scores and values, 12 L (n_head x head_dim) T (PaLM
        appendix B; GQA shares k/v, not scores)."""
        c = self.cfg
        return 6.0 * self.active_params() + 12.0 * c.n_layer * c.n_head * c.head_dim * c.block_size


def model_config(section: dict) -> LlamaConfig:
    """LlamaConfig from a [model] section: keys it does not have (other families', at their
    defaults) dropped; the moe_* keys become its MoEConfig (moe_experts 0 or absent: dense)."""
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    kwargs = {k: v for k, v in section.items() if k in names}
    moe = moe_config_kwargs(section)
    if moe is not None:
        kwargs["moe"] = MoEConfig(**moe)
    return LlamaConfig(**kwargs)


def build(section: dict) -> Llama:
    """A fresh Llama (initialized from torch's global RNG) of a [model] section (ModelSpec.module)."""
    return Llama(model_config(section))
