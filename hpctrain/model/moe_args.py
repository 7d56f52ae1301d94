"""The mixture-of-experts [model] keys (a [model.moe] table's keys are these without moe_), shared by
the families whose feed-forward may be model/moe.py's MoEFeedForward, and their rules.

Owns: the keys, their checks and the MoEConfig arguments they give. It must never import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class MoEArgs:
    moe_experts: int = field(default=0, metadata={
        "help": "MoE: routed experts per sparse layer (0 = dense model)"})
    moe_top_k: int = field(default=2, metadata={"help": "MoE: experts each token is routed to"})
    moe_expert_hidden: int = field(default=0, metadata={
        "help": "MoE: each expert's SwiGLU width (0 = the dense ffn width)"})
    moe_shared_experts: int = field(default=0, metadata={
        "help": "MoE: always-on shared experts (Qwen2-MoE, DeepSeek), run as one SwiGLU"})
    moe_shared_hidden: int = field(default=0, metadata={
        "help": "MoE: the shared experts' width (0 = moe_shared_experts x moe_expert_hidden)"})
    moe_shared_gate: bool = field(default=False, metadata={
        "help": "MoE: scale the shared output by a learned sigmoid gate (Qwen2-MoE)"})
    moe_gate: Literal["softmax", "sigmoid"] = field(default="softmax", metadata={
        "help": "MoE: router gates, 'softmax' (Mixtral, Qwen2-MoE) or 'sigmoid' (DeepSeek-V3)"})
    moe_norm_topk_prob: bool = field(default=True, metadata={
        "help": "MoE: renormalize the top-k gates to sum to 1 (Mixtral: true; Qwen2-MoE: false)"})
    moe_aux_loss_coef: float = field(default=0.0, metadata={
        "help": "MoE: weight of the Switch/Mixtral load-balancing loss (0 = off; Mixtral 0.02)"})
    moe_bias_update_rate: float = field(default=0.0, metadata={
        "help": "MoE: DeepSeek-V3's auxiliary-loss-free balancing: the routing bias step per "
                "optimizer step (0 = off; DeepSeek-V3 0.001)"})
    moe_every: int = field(default=1, metadata={
        "help": "MoE: layer i is sparse when (i + 1) % moe_every == 0 (Qwen2-MoE's decoder_sparse_step)"})
    moe_first_dense: int = field(default=0, metadata={
        "help": "MoE: the first layers stay dense (DeepSeek's first_k_dense_replace)"})
    moe_warn_ratio: float = field(default=3.0, metadata={
        "help": "MoE: warn when an expert receives more than this multiple of the layer's mean "
                "load for moe_warn_steps steps in a row (metrics: moe.<layer>.max_mean)"})
    moe_warn_steps: int = field(default=50, metadata={
        "help": "MoE: see moe_warn_ratio"})


def n_experts(m) -> int:
    """Routed experts per sparse layer (0: dense): the ModelSpec.n_experts of a family with MoEArgs."""
    return m.moe_experts


def is_sparse(m, layer: int) -> bool:
    """Layer `layer` holds a MoE feed-forward (moe_every, moe_first_dense)."""
    return m.moe_experts > 0 and layer >= m.moe_first_dense and (layer + 1) % m.moe_every == 0


def check_moe(m, check) -> None:
    """The MoE keys' rules (`check(ok, key, why)`)."""
    check(m.moe_experts >= 0, "model.moe_experts", "must be >= 0 (0 = dense)")
    if m.moe_experts == 0:
        return
    check(1 <= m.moe_top_k <= m.moe_experts, "model.moe_top_k", f"{m.moe_top_k}: must be in [1, "
          f"model.moe_experts={m.moe_experts}]")
    for key in ("moe_expert_hidden", "moe_shared_experts", "moe_shared_hidden", "moe_first_dense"):
        check(getattr(m, key) >= 0, f"model.{key}", "must be >= 0")
    check(m.moe_aux_loss_coef >= 0, "model.moe_aux_loss_coef", "must be >= 0 (0 = off)")
    check(m.moe_bias_update_rate >= 0, "model.moe_bias_update_rate", "must be >= 0 (0 = off)")
    check(m.moe_every >= 1, "model.moe_every", "must be >= 1")
    check(m.moe_warn_ratio > 1, "model.moe_warn_ratio", f"{m.moe_warn_ratio}: must be > 1 (a multiple "
          f"of the mean load)")
    check(m.moe_warn_steps >= 1, "model.moe_warn_steps", "must be >= 1")
    check(m.moe_first_dense < m.n_layer, "model.moe_first_dense",
          f"{m.moe_first_dense}: leaves no sparse layer of model.n_layer={m.n_layer}")


MOE_CONFIG_KEYS = ("top_k", "expert_hidden", "shared_hidden", "shared_gate", "gate", "norm_topk_prob",
                   "aux_loss_coef", "bias_update_rate")


def moe_config_kwargs(section: dict) -> dict | None:
    """model/moe.py MoEConfig's arguments from a [model] section's moe_* keys (None: dense)."""
    if section.get("moe_experts", 0) <= 0:
        return None
    return {"n_experts": section["moe_experts"], "n_shared_experts": section.get("moe_shared_experts", 0),
            **{k: section[f"moe_{k}"] for k in MOE_CONFIG_KEYS if f"moe_{k}" in section}}
