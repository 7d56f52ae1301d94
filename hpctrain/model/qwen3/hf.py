"""Hugging Face <-> hpctrain for the Qwen3 family: Qwen3ForCausalLM (model_type "qwen3") and
Qwen3MoeForCausalLM ("qwen3_moe"): config.json <-> [model] section, our state dict -> HF's
(export) and, per parameter, the HF tensor init.from reads (HFSpec's functions).

Owns: the names and the config keys. No tensor is changed but the stacked experts (ours [E, H, C],
HF's one tensor per expert, `...mlp.experts.{e}.gate_proj.weight`, as save_pretrained writes them):
rotary uses HF's rotate_half layout, so q/k load without a permutation. The MoE balancing bias of
ours (router.bias, DeepSeek-V3's) has no Qwen3-MoE tensor: 0 on import, not exported. Reading or
writing files is the import / export commands' (hpctrain/interop/, hpctrain/export.py).
Must never import transformers.
"""
from __future__ import annotations

import re

from hpctrain.errors import UserError
from hpctrain.model.qwen3.args import Qwen3Args

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# ours (inside blocks.{i}.) -> HF (inside model.layers.{i}.); {e}: one tensor per expert
_BLOCK = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
          "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
          "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
          "mlp.proj.weight": "mlp.down_proj.weight", "mlp.router.weight": "mlp.gate.weight",
          "mlp.experts.w1": "mlp.experts.{e}.gate_proj.weight",
          "mlp.experts.w3": "mlp.experts.{e}.up_proj.weight",
          "mlp.experts.w2": "mlp.experts.{e}.down_proj.weight"}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_NO_HF_TENSOR = "mlp.router.bias"


def to_hf_name(name: str) -> str | None:
    """Our parameter name -> HF's ('{e}' in it: one tensor per expert; None: the balancing bias)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is not None and m.group(2) == _NO_HF_TENSOR:
        return None
    if m is None or m.group(2) not in _BLOCK:
        raise UserError(f"parameter {name!r}: not a parameter of hpctrain's qwen3 architecture")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def source_of(fqn: str, section: dict) -> tuple[str, bool, int] | None:
    """(HF tensor name, transposed, row offset) init.from reads our parameter from (HFSpec; '{e}':
    the experts stacked); None: no HF tensor (the balancing bias, 0)."""
    if fqn == "lm_head.weight" and section.get("tie_embeddings"):
        return "model.embed_tokens.weight", False, 0
    name = to_hf_name(fqn)
    return None if name is None else (name, False, 0)


def to_hf_state_dict(state: dict, args: Qwen3Args) -> dict:
    """Our state dict -> HF's: a tied head saved once (as the embedding), experts split apart, the
    balancing bias left out."""
    out = {}
    for name, value in state.items():
        hf = to_hf_name(name)
        if hf is None or (args.tie_embeddings and name == "lm_head.weight"):
            continue
        if "{e}" in hf:
            out.update({hf.format(e=e): value[e].contiguous() for e in range(value.shape[0])})
        else:
            out[hf] = value
    return out


def model_type(args: Qwen3Args) -> str:
    return "qwen3_moe" if args.moe_experts else "qwen3"


def hf_config(args: Qwen3Args) -> dict:
    """config.json of Qwen3ForCausalLM (dense) or Qwen3MoeForCausalLM (moe_experts > 0)."""
    kind = model_type(args)
    cfg = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": args.vocab_size,
           "hidden_size": args.n_embd, "intermediate_size": args.ffn_hidden_size,
           "num_hidden_layers": args.n_layer, "num_attention_heads": args.n_head,
           "num_key_value_heads": args.kv_heads, "head_dim": args.head_width, "hidden_act": "silu",
           "max_position_embeddings": args.max_positions or args.block_size,
           "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
           "tie_word_embeddings": args.tie_embeddings, "attention_bias": False,
           "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
           "torch_dtype": "float32"}
    if args.moe_experts:
        cfg.update(num_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                   moe_intermediate_size=args.expert_hidden, norm_topk_prob=args.moe_norm_topk_prob,
                   decoder_sparse_step=args.moe_every, mlp_only_layers=list(range(args.moe_first_dense)),
                   router_aux_loss_coef=args.moe_aux_loss_coef, output_router_logits=False)
    return cfg


def _refuse_unsupported(cfg: dict) -> None:
    """One UserError naming the first config.json field this family cannot reproduce."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act {cfg['hidden_act']!r}: only 'silu' is supported")
    if cfg.get("attention_bias"):
        raise UserError("config.json: attention_bias true: hpctrain's qwen3 has no q/k/v/o bias")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise UserError("config.json: use_sliding_window / sliding_attention layers: not supported")
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UserError(f"config.json: {key} {rope!r}: only the default rope is supported "
                            f"(no YaRN / long-context scaling)")


def _dense_prefix(layers: list) -> int:
    """mlp_only_layers [0, .., k-1] -> k (model.moe_first_dense); any other list: UserError."""
    if sorted(layers) != list(range(len(layers))):
        raise UserError(f"config.json: mlp_only_layers {layers}: only the first layers may be dense "
                        f"([0, 1, .., k-1], model.moe_first_dense = k)")
    return len(layers)


def section_from_config(cfg: dict) -> dict:
    """The [model] section (arch "qwen3") of a Qwen3 / Qwen3-MoE config.json; a missing required
    field is a KeyError naming it (hf_import names the file)."""
    if cfg.get("model_type") not in ARCHITECTURES:
        raise UserError(f"config.json: model_type {cfg.get('model_type')!r} is not one of {sorted(ARCHITECTURES)}")
    _refuse_unsupported(cfg)
    rope = cfg.get("rope_parameters") or {}
    positions = cfg.get("max_position_embeddings", 40960)
    section = {"arch": "qwen3", "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
               "n_embd": cfg["hidden_size"], "n_kv_head": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
               "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
               "block_size": positions, "max_positions": positions, "vocab_size": cfg["vocab_size"],
               "ffn_hidden": cfg["intermediate_size"], "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
               "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta") or 1000000.0),
               "tie_embeddings": bool(cfg.get("tie_word_embeddings", False))}
    if cfg["model_type"] == "qwen3_moe":
        experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 writes the latter
        section.update(moe_experts=experts, moe_top_k=cfg.get("num_experts_per_tok", 8),
                       moe_expert_hidden=cfg["moe_intermediate_size"],
                       moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       moe_every=cfg.get("decoder_sparse_step", 1),
                       moe_first_dense=_dense_prefix(cfg.get("mlp_only_layers") or []),
                       moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))
    return section


def alias(name: str, section: dict) -> tuple[str, bool] | None:
    """A tied model's lm_head.weight in a folder: a copy of the embedding (HFSpec)."""
    if name == "lm_head.weight" and section.get("tie_embeddings"):
        return "model.embed_tokens.weight", False
    return None


def export(state: dict, section: dict) -> tuple[dict, dict]:
    """(HF state dict in fp32, config.json) of a checkpoint's model tensors and [model] section:
    what `hpctrain export --format hf` writes for this family (HFSpec)."""
    from hpctrain.model.qwen3.model import model_config

    args = model_config(section)
    tensors = to_hf_state_dict({k: v.float().contiguous() for k, v in state.items()}, args)
    return tensors, hf_config(args)
