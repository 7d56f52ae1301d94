"""Hugging Face <-> hpctrain mapping for the Llama family (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM): parameter names both ways and config.json <-> [model] section.

Owns: the names and the config keys only (the family's HFSpec functions at the end); reading / writing safetensors, sharding and tokenizer
files belong to the import / export commands that use it. No tensor is changed: our rotary
embedding uses HF's rotate_half layout, so q/k weights need no permutation, and nn.Linear weights
are [out, in] on both sides. Names are per-parameter, so a rank can map only the slices it holds.
"""
from __future__ import annotations

import re

from hpctrain.errors import UserError
from hpctrain.model.llama import hf_moe

# ours (inside blocks.{i}.) -> HF (inside model.layers.{i}.)
_BLOCK = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wq.bias": "self_attn.q_proj.bias",
          "attn.wk.weight": "self_attn.k_proj.weight", "attn.wk.bias": "self_attn.k_proj.bias",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wv.bias": "self_attn.v_proj.bias",
          "attn.wo.weight": "self_attn.o_proj.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
          "mlp.up.weight": "mlp.up_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
# HF buffers some versions save; they carry no weights
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", **hf_moe.MOE_TYPES}
_HF_MOE = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe\.|mlp\.(experts|gate|shared_expert|shared_expert_gate)\.)")


def to_hf_name(name: str, moe_kind: str | None = None) -> str | None:
    """Our parameter name (as in Llama.state_dict()) -> HF's ('{e}' in it: one per expert; None:
    the MoE balancing bias, which HF has no tensor for)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is not None and moe_kind is not None and hf_moe.is_moe_param(m.group(2)):
        return hf_moe.hf_moe_name(m.group(1), m.group(2), moe_kind)
    if m is None or m.group(2) not in _BLOCK:
        raise UserError(f"parameter {name!r}: not a parameter of hpctrain's llama architecture")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def from_hf_name(name: str) -> str | None:
    """HF's parameter name -> ours (None for a buffer that holds no weights)."""
    if _HF_IGNORED.fullmatch(name):
        return None
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _BLOCK_BACK:
        raise UserError(f"Hugging Face parameter {name!r}: not in a Llama / Mistral / Qwen2 model")
    return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"


def to_hf_state_dict(state: dict, tied: bool, moe_kind: str | None = None) -> dict:
    """Our state dict -> HF's (a tied head is saved once, as the embedding, as HF does; stacked
    experts split one tensor per expert)."""
    moe = {k: v for k, v in state.items() if moe_kind and re.fullmatch(r"blocks\.\d+\.mlp\..+", k)
           and hf_moe.is_moe_param(k.split(".", 2)[2])}
    dense = {to_hf_name(k): v for k, v in state.items()
             if k not in moe and not (tied and k == "lm_head.weight")}
    return {**dense, **(hf_moe.split_experts(moe, moe_kind) if moe else {})}


def from_hf_state_dict(state: dict, tied: bool, moe_kind: str | None = None) -> dict:
    """HF's state dict -> ours; with tied embeddings lm_head.weight is the embedding; the experts
    of `moe_kind`'s sparse layers stacked."""
    out, moe_layers = {}, set()
    for k, v in state.items():
        hit = _HF_MOE.match(k) if moe_kind else None
        if hit:
            moe_layers.add(int(hit.group(1)))
            continue
        ours = from_hf_name(k)
        if ours is not None:
            out[ours] = v
    if moe_layers:
        out.update(hf_moe.stack_experts(state, moe_kind, sorted(moe_layers)))
    if tied:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out


def hf_config(model: dict, model_type: str = "llama") -> dict:
    """config.json of HF's `model_type` ("llama" | "mistral" | "qwen2") for a [model] section."""
    from hpctrain.model.llama.model import LlamaConfig, model_config

    c: LlamaConfig = model_config({**model, "arch": "llama"})
    if model_type not in ARCHITECTURES:
        raise UserError(f"model type {model_type!r}: expected one of {sorted(ARCHITECTURES)}")
    cfg = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
           "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden_size,
           "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
           "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
           "max_position_embeddings": c.max_positions or c.block_size, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings,
           "attention_dropout": 0.0, "torch_dtype": "float32"}
    if c.rope_scaling_factor > 0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": c.rope_scaling_factor,
                               "low_freq_factor": c.rope_low_freq_factor,
                               "high_freq_factor": c.rope_high_freq_factor,
                               "original_max_position_embeddings": c.rope_original_max_positions}
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
        if c.qkv_bias:
            raise UserError("model.qkv_bias = true (bias on q/k/v only) has no LlamaForCausalLM "
                            "equivalent: export it as qwen2")
    elif model_type == "mistral":
        cfg["sliding_window"] = None
    if model_type in hf_moe.MOE_TYPES:
        cfg.update(hf_moe.hf_moe_config(c, model_type))
    return cfg


def model_section_from_hf(cfg: dict) -> dict:
    """The [model] section of an HF config.json (Llama / Mistral / Qwen2)."""
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise UserError(f"config.json: model_type {kind!r} is not one of {sorted(ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act {cfg['hidden_act']!r}: only 'silu' is supported")
    if cfg.get("mlp_bias") or (kind == "llama" and cfg.get("attention_bias")):
        raise UserError("config.json: mlp_bias / attention_bias (o_proj bias): not supported; "
                        "hpctrain's llama has optional q/k/v bias only (Qwen2)")
    n_head, width = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim") not in (None, width // n_head):
        raise UserError(f"config.json: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
    if kind in ("mistral", "mixtral") and cfg.get("sliding_window") not in (None, 0) \
            and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
        raise UserError(f"config.json: sliding_window {cfg['sliding_window']}: not supported")
    # transformers >= 5 writes "rope_parameters" (theta inside), 4.x "rope_theta" + "rope_scaling"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = {"arch": "llama", "n_layer": cfg["num_hidden_layers"], "n_head": n_head, "n_embd": width,
               "n_kv_head": cfg.get("num_key_value_heads") or n_head,
               "block_size": cfg.get("max_position_embeddings", 2048),
               "max_positions": cfg.get("max_position_embeddings", 2048), "vocab_size": cfg["vocab_size"],
               "ffn_hidden": cfg["intermediate_size"], "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
               "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
               "qkv_bias": kind in ("qwen2", "qwen2_moe"),
               "tie_embeddings": bool(cfg.get("tie_word_embeddings", False))}
    if kind in hf_moe.MOE_TYPES:
        section.update(hf_moe.moe_section_from_hf(cfg))
    rope_kind = rope.get("rope_type", rope.get("type", "default"))
    if rope_kind not in ("default", "llama3"):
        raise UserError(f"config.json: rope scaling {rope!r}: only rope_type 'llama3' is supported")
    if rope_kind == "llama3":
        section.update(rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_positions=int(rope["original_max_position_embeddings"]))
    return section


# ---- the HFSpec functions (hpctrain/model/spec.py) ------------------------------------------
def _moe_kind(section: dict) -> str | None:
    return hf_moe.moe_type(section) if section.get("moe_experts") else None


def section_from_config(cfg: dict) -> dict:
    """config.json -> the [model] keys (HFSpec)."""
    return model_section_from_hf(cfg)


def export(state: dict, section: dict) -> tuple[dict, dict]:
    """(HF state dict, config.json) of a checkpoint's fp32 tensors: Qwen2ForCausalLM with
    model.qkv_bias, else LlamaForCausalLM; with experts MixtralForCausalLM or, with a gated
    shared expert, Qwen2MoeForCausalLM."""
    kind = _moe_kind(section)
    config = hf_config(section, kind or ("qwen2" if section.get("qkv_bias") else "llama"))
    tied = bool(section.get("tie_embeddings"))
    return to_hf_state_dict(state, tied, kind), config


def source_of(fqn: str, section: dict) -> tuple[str, bool, int] | None:
    """The HF tensor init.from reads our parameter from (HFSpec)."""
    if fqn == "lm_head.weight" and section.get("tie_embeddings"):
        return "model.embed_tokens.weight", False, 0
    name = to_hf_name(fqn, _moe_kind(section))
    return None if name is None else (name, False, 0)


def alias(name: str, section: dict) -> tuple[str, bool] | None:
    """A tied model's lm_head.weight in a folder: a copy of the embedding (HFSpec)."""
    if name == "lm_head.weight" and section.get("tie_embeddings"):
        return "model.embed_tokens.weight", False
    return None
