"""The Qwen3 / Qwen3-MoE architecture only: Llama's block (RMSNorm, rotary, SwiGLU, GQA) with the
head width decoupled from n_embd, an RMSNorm over each q and k head before rope, no q/k/v bias,
and Qwen3-MoE's sparse layers (hpctrain/model/moe.py's layer: softmax top-k, no shared expert).

Owns: the attention (the part that differs: wq [n_head x head_dim, C], wk / wv [n_kv_head x
head_dim, C], wo [C, n_head x head_dim], q_norm / k_norm [head_dim]), the block and the model, their
parameter names, the FLOP estimate, `build(section)` (ModelSpec.module). Reused by import: llama's
RMSNorm, rotate_half, SwiGLU, embed and parameter counts, moe.py's MoEFeedForward, gpt2's
forward / init / generate. Like them it must never import distributed, checkpoint, data or loss
code: layouts are applied from outside (parallelize.py in this folder's spec.py), Hugging Face
names are hf.py's.

Kept the same as gpt.py / llama.py so every layout works unchanged: tok_emb, pos_emb (None: rotary),
drop, blocks ("0".."L-1"), norm_f, lm_head; blocks with norm1 / attn.{wq,wk,wv,wo} / norm2 / mlp.
Numerics follow transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM (logits <= 1e-4 in fp32,
tests/unit/test_qwen3.py): the norms in fp32 cast back before the weight, rope cos/sin in fp32 with
HF's rotate_half layout (no q/k permutation on import).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from hpctrain.model.attention import causal_attention, rope_angles
from hpctrain.model.gpt2.model import GPT, Block
from hpctrain.model.llama.model import Llama, RMSNorm, SwiGLU, rotate_half
from hpctrain.model.moe import MoEConfig, MoEFeedForward
from hpctrain.model.qwen3.args import Qwen3Args


def rope_cos_sin(args: Qwen3Args, t: int, device, dtype,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, head width] for positions 0..t-1 (HF's default rope; [B, 1, T, head width]
    for ``positions`` [B, T]), fp32, then `dtype`."""
    d = args.head_width
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    emb = rope_angles(inv_freq, t, positions)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def moe_config(args: Qwen3Args) -> MoEConfig:
    """A sparse layer's config (model/moe.py): softmax gates, no shared expert."""
    return MoEConfig(n_experts=args.moe_experts, top_k=args.moe_top_k, expert_hidden=args.expert_hidden,
                     norm_topk_prob=args.moe_norm_topk_prob, aux_loss_coef=args.moe_aux_loss_coef)


class Qwen3Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args, self.head_dim = args, args.head_width
        self.wq = nn.Linear(args.n_embd, args.q_dim, bias=False)
        self.wk = nn.Linear(args.n_embd, args.kv_dim, bias=False)
        self.wv = nn.Linear(args.n_embd, args.kv_dim, bias=False)
        self.wo = nn.Linear(args.q_dim, args.n_embd, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)  # over each head, shared by all
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.dropout = args.dropout
        self.attend = causal_attention  # the attention kernel; parallel/ may swap it (context parallelism)
        self.resid_drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; doc_ids / positions [B, T]: see GPT.forward."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp and n_kv_head / tp heads
        q = self.q_norm(self.wq(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(self.args, t, q.device, q.dtype, positions)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = self.attend(q, k, v, doc_ids, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.wo(y.transpose(1, 2).reshape(b, t, -1)))


class Qwen3Block(Block):
    """GPT's pre-norm residual block (its forward) with Qwen3's pieces."""

    def __init__(self, args: Qwen3Args, layer: int):
        nn.Module.__init__(self)
        self.norm1 = RMSNorm(args.n_embd, args.rms_norm_eps)
        self.attn = Qwen3Attention(args)
        self.norm2 = RMSNorm(args.n_embd, args.rms_norm_eps)
        self.mlp = (MoEFeedForward(args.n_embd, args.expert_hidden, moe_config(args))
                    if args.is_sparse(layer) else SwiGLU(args))


class Qwen3(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.cfg = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.n_embd)
        self.pos_emb = None  # rotary positions, inside attention
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleDict({str(i): Qwen3Block(args, i) for i in range(args.n_layer)})
        self.norm_f = RMSNorm(args.n_embd, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    reset_parameters = GPT.reset_parameters  # N(0, 0.02), wo / proj / w2 by 1/sqrt(2L), norms 1
    generate = GPT.generate
    forward = GPT.forward  # embed -> blocks -> norm_f -> lm_head; a pipeline stage: pieces None

    embed = Llama.embed
    num_params = Llama.num_params
    active_params = Llama.active_params

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N (N active) + 12 L (n_head x head_dim) T (scores and values)."""
        a = self.cfg
        return 6.0 * self.active_params() + 12.0 * a.n_layer * a.q_dim * a.block_size


def model_config(section: dict) -> Qwen3Args:
    """Qwen3Args of a [model] section (other families' keys, at their defaults, dropped)."""
    names = {f.name for f in dataclasses.fields(Qwen3Args)}
    return Qwen3Args(**{k: v for k, v in section.items() if k in names})


def build(section: dict) -> Qwen3:
    """A fresh Qwen3 (initialized from torch's global RNG) of a [model] section (ModelSpec.module)."""
    return Qwen3(model_config(section))
