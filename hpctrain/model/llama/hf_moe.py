"""Hugging Face <-> hpctrain mapping for mixture-of-experts models: MixtralForCausalLM and
Qwen2MoeForCausalLM (routed experts + a gated shared expert), on top of hf.py's dense names.

Owns: the MoE layers' names both ways (HF stores each expert's matrices apart,
`...experts.{e}.w1.weight`; ours are stacked [E, H, C] tensors, so one of ours maps to E of
theirs: `expert_sources` gives the per-expert names a reader stacks, `split_experts` the tensors
an exporter writes) and the config.json keys. The routing-balance bias of ours has no HF tensor
(Mixtral and Qwen2-MoE have none): it starts at 0 on import and is not exported.
"""
from __future__ import annotations

import re

import torch

from hpctrain.errors import UserError

MOE_TYPES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# ours (inside blocks.{i}.mlp.) -> HF (inside model.layers.{i}.), per model type; {e}: the expert
_NAMES = {
    "mixtral": {"router.weight": "block_sparse_moe.gate.weight",
                "experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
                "experts.w3": "block_sparse_moe.experts.{e}.w3.weight",
                "experts.w2": "block_sparse_moe.experts.{e}.w2.weight"},
    "qwen2_moe": {"router.weight": "mlp.gate.weight",
                  "experts.w1": "mlp.experts.{e}.gate_proj.weight",
                  "experts.w3": "mlp.experts.{e}.up_proj.weight",
                  "experts.w2": "mlp.experts.{e}.down_proj.weight",
                  "shared.w1": "mlp.shared_expert.gate_proj.weight",
                  "shared.w3": "mlp.shared_expert.up_proj.weight",
                  "shared.w2": "mlp.shared_expert.down_proj.weight",
                  "shared_gate.weight": "mlp.shared_expert_gate.weight"},
}
_BIAS = "router.bias"


def moe_type(section: dict) -> str:
    """The HF model type a [model] section with experts exports as (and imports from)."""
    if section.get("moe_bias_update_rate", 0):
        raise UserError("model.moe_bias_update_rate > 0: the routing-balance bias has no tensor in "
                        "Mixtral or Qwen2-MoE, so their routing would differ from this model's")
    if section.get("moe_shared_experts", 0):
        if not section.get("moe_shared_gate") or not section.get("qkv_bias"):
            raise UserError("model.moe_shared_experts without moe_shared_gate and qkv_bias has no "
                            "Hugging Face class (Qwen2-MoE has both)")
        return "qwen2_moe"
    if (section.get("moe_gate", "softmax") != "softmax" or not section.get("moe_norm_topk_prob", True)
            or section.get("moe_every", 1) != 1 or section.get("moe_first_dense", 0)):
        raise UserError("this MoE layout (sigmoid gates, unnormalized top-k or dense layers) has no "
                        "Hugging Face class here: Mixtral routes every layer with softmax top-k")
    return "mixtral"


def is_moe_param(rest: str) -> bool:
    """`rest` (a block parameter's name after blocks.{i}.) belongs to a sparse layer's mlp."""
    return rest.startswith(("mlp.router.", "mlp.experts.", "mlp.shared.", "mlp.shared_gate."))


def hf_moe_name(layer: str, rest: str, kind: str) -> str | None:
    """HF's name (with '{e}' for the expert) of our block parameter blocks.{layer}.{rest}; None
    for the balancing bias, which HF does not have."""
    key = rest.removeprefix("mlp.")
    if key == _BIAS:
        return None
    if key not in _NAMES[kind]:
        raise UserError(f"parameter blocks.{layer}.{rest}: no {MOE_TYPES[kind]} equivalent")
    return f"model.layers.{layer}.{_NAMES[kind][key]}"


def split_experts(state: dict, kind: str) -> dict:
    """Our MoE tensors of a state dict -> HF's (stacked experts split apart; no balancing bias)."""
    out = {}
    for name, value in state.items():
        layer, rest = re.fullmatch(r"blocks\.(\d+)\.(.+)", name).groups()
        hf = hf_moe_name(layer, rest, kind)
        if hf is None:
            continue
        if "{e}" in hf:
            out.update({hf.format(e=e): value[e].contiguous() for e in range(value.shape[0])})
        else:
            out[hf] = value[0].contiguous() if rest.startswith("mlp.shared.") else value
    return out


def stack_experts(hf_state: dict, kind: str, layers: list[int]) -> dict:
    """HF's MoE tensors of `layers` -> ours (experts stacked, shared ones given their expert dim,
    balancing bias 0)."""
    out = {}
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for ours, hf in _NAMES[kind].items():
            if "{e}" in hf:
                n = sum(1 for k in hf_state if re.fullmatch(re.escape(prefix + hf).replace(r"\{e\}", r"\d+"), k))
                out[f"blocks.{layer}.mlp.{ours}"] = torch.stack([hf_state[prefix + hf.format(e=e)] for e in range(n)])
            else:
                value = hf_state[prefix + hf]
                out[f"blocks.{layer}.mlp.{ours}"] = value[None] if ours.startswith("shared.") else value
        out[f"blocks.{layer}.mlp.{_BIAS}"] = torch.zeros(out[f"blocks.{layer}.mlp.router.weight"].shape[0])
    return out


def hf_moe_config(c, kind: str) -> dict:
    """The MoE keys of config.json for a LlamaConfig `c` with experts."""
    m = c.moe
    if kind == "mixtral":
        return {"num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                "intermediate_size": m.expert_hidden or c.ffn_hidden_size, "sliding_window": None,
                "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False}
    return {"num_experts": m.n_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_hidden or c.ffn_hidden_size,
            "shared_expert_intermediate_size": m.shared_hidden or (m.expert_hidden or c.ffn_hidden_size),
            "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": c.moe_every,
            "mlp_only_layers": [], "intermediate_size": c.ffn_hidden_size,
            "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False}


def moe_section_from_hf(cfg: dict) -> dict:
    """The [model] MoE keys of a Mixtral / Qwen2-MoE config.json (architecture only: the aux
    loss weight is a training choice, left to the user)."""
    if cfg["model_type"] == "mixtral":
        return {"moe_experts": cfg["num_local_experts"], "moe_top_k": cfg["num_experts_per_tok"],
                "moe_expert_hidden": cfg["intermediate_size"]}
    if cfg.get("mlp_only_layers"):
        raise UserError(f"config.json: mlp_only_layers {cfg['mlp_only_layers']}: not supported "
                        f"(dense layers follow decoder_sparse_step only)")
    return {"moe_experts": cfg["num_experts"], "moe_top_k": cfg["num_experts_per_tok"],
            "moe_expert_hidden": cfg["moe_intermediate_size"], "moe_shared_experts": 1,
            "moe_shared_hidden": cfg["shared_expert_intermediate_size"], "moe_shared_gate": True,
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_every": cfg.get("decoder_sparse_step", 1)}
