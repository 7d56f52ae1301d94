"""The DeepSeek-V3-style model (architecture only): pre-norm blocks of multi-head latent attention
(attention.py) and a feed-forward that is llama's SwiGLU in the first `moe_first_dense` layers and
in the others the mixture of experts of hpctrain/model/moe.py (shared + routed SwiGLU experts)
with DeepSeek-V3's router: sigmoid scores, the balancing bias (HF's e_score_correction_bias)
moving the choice only, group-limited choice, top-k gates renormalized and scaled.

Kept the same as gpt.py / llama.py so every layout works: tok_emb, pos_emb (None: rotary), drop,
blocks (ModuleDict "0".."L-1") with norm1 / attn / norm2 / mlp, norm_f, lm_head; a sparse layer's
mlp is a MoEFeedForward (router.weight, router.bias, experts.w1/w2/w3, shared.w1/w2/w3), so expert
parallelism and the balancing-bias update treat it as any MoE layer. Never imports distributed,
checkpoint, data or loss code. Numerics follow transformers' DeepseekV3ForCausalLM (logits within
1e-4 fp32: tests/unit/test_deepseek_v3.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.deepseek_v3.args import DeepseekV3Config
from hpctrain.model.deepseek_v3.attention import LatentAttention
from hpctrain.model.gpt import GPT, Block
from hpctrain.model.llama import Llama, RMSNorm, SwiGLU
from hpctrain.model.moe import MoEConfig, MoEFeedForward, Router


def moe_config(args: DeepseekV3Config) -> MoEConfig:
    """moe.py's config of the sparse layers (sigmoid gates; the shared experts one SwiGLU)."""
    return MoEConfig(n_experts=args.moe_experts, top_k=args.moe_top_k, expert_hidden=args.expert_hidden,
                     n_shared_experts=args.moe_shared_experts, gate="sigmoid",
                     norm_topk_prob=args.moe_norm_topk_prob, aux_loss_coef=args.moe_aux_loss_coef,
                     bias_update_rate=args.moe_bias_update_rate)


class GroupLimitedRouter(Router):
    """DeepSeek-V3's router: scores sigmoid(x W^T) in fp32; the choice is scores + bias, limited
    to the `moe_topk_groups` groups (of `moe_groups` equal runs of experts) whose two best choice
    scores sum highest; gates are the chosen scores (no bias), renormalized (+1e-20) and scaled."""

    def __init__(self, dim: int, args: DeepseekV3Config):
        super().__init__(dim, moe_config(args))
        self.groups, self.topk_groups, self.scale = args.moe_groups, args.moe_topk_groups, args.moe_routed_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, C] -> (gates [T, k] fp32, expert ids [T, k], scores [T, E] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.bias.float()
        if self.topk_groups < self.groups:
            per_group = choice.view(x.shape[0], self.groups, -1)
            best = per_group.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
            kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = per_group.masked_fill(~kept[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(self.cfg.top_k, dim=-1).indices
        gates = scores.gather(-1, ids)
        if self.cfg.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        return gates * self.scale, ids, scores


class DeepseekV3Block(Block):
    """GPT's pre-norm residual block (its forward) with MLA and a dense or sparse feed-forward."""

    def __init__(self, args: DeepseekV3Config, layer: int):
        nn.Module.__init__(self)
        self.norm1 = RMSNorm(args.n_embd, args.rms_norm_eps)
        self.attn = LatentAttention(args)
        self.norm2 = RMSNorm(args.n_embd, args.rms_norm_eps)
        if args.is_sparse(layer):
            self.mlp = MoEFeedForward(args.n_embd, args.expert_hidden, moe_config(args))
            self.mlp.router = GroupLimitedRouter(args.n_embd, args)
        else:
            self.mlp = SwiGLU(args)


class DeepseekV3(nn.Module):
    def __init__(self, args: DeepseekV3Config):
        super().__init__()
        self.cfg = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.n_embd)
        self.pos_emb = None  # rotary positions, inside attention
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleDict({str(i): DeepseekV3Block(args, i) for i in range(args.n_layer)})
        self.norm_f = RMSNorm(args.n_embd, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    reset_parameters = GPT.reset_parameters  # N(0, 0.02), wo / mlp.proj / w2 by 1/sqrt(2L), norms 1
    generate = GPT.generate
    forward = GPT.forward  # embed -> blocks -> norm_f -> lm_head; a pipeline stage: pieces None
    embed = Llama.embed
    num_params = Llama.num_params
    active_params = Llama.active_params

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls (N: the active parameters) plus attention's
        scores (qk width) and values (v width): 6 L n_head (nope + rope + v) T."""
        a = self.cfg
        return 6.0 * self.active_params() + 6.0 * a.n_layer * a.n_head * (a.qk_head_dim + a.v_head_dim) * a.block_size


def model_config(section: dict) -> DeepseekV3Config:
    """The config of a [model] section (other families' keys, at their defaults, dropped)."""
    return DeepseekV3Config.from_section(section)


def build(section: dict) -> DeepseekV3:
    """A fresh model (initialized from torch's global RNG) of a [model] section (ModelSpec.module)."""
    return DeepseekV3(model_config(section))
