"""Hugging Face DeepseekV3ForCausalLM <-> this family: config.json <-> [model] section, parameter
names both ways, the export's tensors. Names only, and one split: HF's kv_a_proj_with_mqa is our
kv_a (its first kv_lora_rank rows) stacked on k_rope (the last qk_rope_head_dim rows), so a reader
takes our tensor from a row offset (`source_of`) and the export stacks the two. Experts: HF's files
hold one tensor per expert (`...experts.{e}.gate_proj.weight`; transformers fuses them when it
loads), ours are stacked [E, H, C]; the shared experts one [1, S, C] SwiGLU; our balancing bias is
HF's e_score_correction_bias. Never reads or writes files, never imports transformers.
"""
from __future__ import annotations

import re

import torch

from hpctrain.errors import UserError
from hpctrain.model.deepseek_v3.args import ARCH, DeepseekV3Config

MODEL_TYPE = ARCH
ARCHITECTURE = "DeepseekV3ForCausalLM"
# ours (inside blocks.{i}.) -> HF (inside model.layers.{i}.); {e}: one HF tensor per expert
_BLOCK = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
          "attn.q_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
          "attn.q_b.weight": "self_attn.q_b_proj.weight", "attn.wq.weight": "self_attn.q_proj.weight",
          "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attn.k_rope.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight", "attn.kv_b.weight": "self_attn.kv_b_proj.weight",
          "attn.wo.weight": "self_attn.o_proj.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
          "mlp.up.weight": "mlp.up_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight",
          "mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.e_score_correction_bias",
          "mlp.experts.w1": "mlp.experts.{e}.gate_proj.weight", "mlp.experts.w3": "mlp.experts.{e}.up_proj.weight",
          "mlp.experts.w2": "mlp.experts.{e}.down_proj.weight",
          "mlp.shared.w1": "mlp.shared_experts.gate_proj.weight",
          "mlp.shared.w3": "mlp.shared_experts.up_proj.weight",
          "mlp.shared.w2": "mlp.shared_experts.down_proj.weight"}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def source_of(fqn: str, section: dict) -> tuple[str, bool, int]:
    """(HF tensor name, transposed, row offset) our parameter `fqn` is read from ('{e}' in the
    name: one tensor per expert, stacked)."""
    if fqn == "lm_head.weight" and section.get("tie_embeddings"):
        return _TOP["tok_emb.weight"], False, 0
    if fqn in _TOP:
        return _TOP[fqn], False, 0
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", fqn)
    if m is None or m.group(2) not in _BLOCK:
        raise UserError(f"parameter {fqn!r}: not a parameter of hpctrain's {ARCH} architecture")
    shift = section.get("kv_lora_rank", 512) if m.group(2) == "attn.k_rope.weight" else 0
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}", False, shift


def to_hf_state_dict(state: dict, section: dict) -> dict:
    """Our state dict -> HF's tensors (kv_a and k_rope stacked, experts split, a tied head once)."""
    out = {}
    for fqn, value in state.items():
        if fqn == "lm_head.weight" and section.get("tie_embeddings"):
            continue
        name, _, _ = source_of(fqn, section)
        if fqn.endswith("attn.k_rope.weight"):
            continue  # stacked below kv_a
        if fqn.endswith("attn.kv_a.weight"):
            value = torch.cat([value, state[fqn.replace("kv_a", "k_rope")]])
        if "{e}" in name:
            out.update({name.format(e=e): value[e].contiguous() for e in range(value.shape[0])})
        else:
            out[name] = (value[0] if ".mlp.shared." in fqn else value).contiguous()
    return out


def hf_config(section: dict) -> dict:
    """config.json of DeepseekV3ForCausalLM for a [model] section of this family."""
    a = DeepseekV3Config.from_section(section)
    if a.moe_experts and a.moe_shared_experts < 1:
        raise UserError("model.moe_shared_experts = 0 has no DeepseekV3ForCausalLM equivalent "
                        "(it always has shared experts); set it >= 1")
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": a.vocab_size,
            "hidden_size": a.n_embd, "intermediate_size": a.ffn_hidden_size,
            "moe_intermediate_size": a.expert_hidden, "num_hidden_layers": a.n_layer,
            "num_attention_heads": a.n_head, "num_key_value_heads": a.n_head,
            "n_shared_experts": a.moe_shared_experts, "n_routed_experts": a.moe_experts or 1,
            "routed_scaling_factor": a.moe_routed_scale, "kv_lora_rank": a.kv_lora_rank,
            "q_lora_rank": a.q_lora_rank or None, "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim, "qk_nope_head_dim": a.qk_nope_head_dim,
            "n_group": a.moe_groups, "topk_group": a.moe_topk_groups,
            "num_experts_per_tok": a.moe_top_k if a.moe_experts else 1,
            "first_k_dense_replace": a.moe_first_dense if a.moe_experts else a.n_layer,
            "norm_topk_prob": a.moe_norm_topk_prob, "hidden_act": "silu",
            "max_position_embeddings": a.max_positions or a.block_size, "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta, "rope_parameters": rope_parameters(a),
            "rope_interleave": a.rope_interleave, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": a.tie_embeddings, "num_nextn_predict_layers": 0,
            "router_aux_loss_coef": a.moe_aux_loss_coef, "torch_dtype": "float32"}


def model_section_from_hf(cfg: dict) -> dict:
    """The [model] section of a DeepseekV3ForCausalLM config.json (KeyError: a field it lacks)."""
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias"):
        raise UserError("config.json: hidden_act other than 'silu' or attention_bias: not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    positions = cfg.get("max_position_embeddings", 4096)
    dense = cfg.get("first_k_dense_replace", 0) >= cfg["num_hidden_layers"]
    return {"arch": ARCH, "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
            "n_embd": cfg["hidden_size"], "block_size": positions, "max_positions": positions,
            "vocab_size": cfg["vocab_size"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
            "kv_lora_rank": cfg["kv_lora_rank"], "qk_nope_head_dim": cfg["qk_nope_head_dim"],
            "qk_rope_head_dim": cfg["qk_rope_head_dim"], "v_head_dim": cfg["v_head_dim"],
            "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            "rope_interleave": bool(cfg.get("rope_interleave", True)),
            "ffn_hidden": cfg["intermediate_size"], "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "moe_experts": 0 if dense else cfg["n_routed_experts"],
            "moe_top_k": cfg["num_experts_per_tok"], "moe_expert_hidden": cfg["moe_intermediate_size"],
            "moe_shared_experts": cfg.get("n_shared_experts") or 0,
            "moe_first_dense": min(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]),
            "moe_groups": cfg.get("n_group") or 1, "moe_topk_groups": cfg.get("topk_group") or 1,
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "moe_routed_scale": float(cfg.get("routed_scaling_factor", 1.0)), **rope_section(rope, positions)}


def rope_parameters(a: DeepseekV3Config) -> dict:
    """config.json's rope_parameters (transformers 5's key; rope_theta inside) of `a`."""
    if a.rope_scaling_factor <= 0:
        return {"rope_type": "default", "rope_theta": a.rope_theta}
    mscales = {k: v for k, v in (("mscale", a.rope_mscale), ("mscale_all_dim", a.rope_mscale_all_dim)) if v}
    return {"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": a.rope_scaling_factor,
            "original_max_position_embeddings": a.rope_original_max_positions,
            "beta_fast": a.rope_beta_fast, "beta_slow": a.rope_beta_slow, **mscales}


def rope_section(rope: dict, positions: int) -> dict:
    """The [model] rope_* keys of config.json's rope_parameters / rope_scaling (default or yarn)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn" or rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
        raise UserError(f"config.json: rope scaling {rope!r}: only the default rope and YaRN (without "
                        f"attention_factor or truncate false) are supported")
    original = int(rope["original_max_position_embeddings"])
    return {"rope_scaling_factor": float(rope.get("factor") or positions / original),
            "rope_original_max_positions": original,
            "rope_beta_fast": float(rope.get("beta_fast") or 32), "rope_beta_slow": float(rope.get("beta_slow") or 1),
            "rope_mscale": float(rope.get("mscale") or 0), "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0)}


def section_from_config(cfg: dict) -> dict:
    """config.json -> the [model] keys (HFSpec)."""
    return model_section_from_hf(cfg)


def export(state: dict, section: dict) -> tuple[dict, dict]:
    """(HF tensors, config.json) of a checkpoint's fp32 tensors (HFSpec)."""
    config = hf_config(section)
    return to_hf_state_dict(state, section), config


def alias(name: str, section: dict) -> tuple[str, bool] | None:
    """A tied model's lm_head.weight in a folder: a copy of the embedding (HFSpec)."""
    if name == "lm_head.weight" and section.get("tie_embeddings"):
        return _TOP["tok_emb.weight"], False
    return None
