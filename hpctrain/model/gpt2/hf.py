"""Hugging Face GPT2LMHeadModel <-> hpctrain gpt2: the [model] section a config.json gives, the
names and layout of the weights both ways.

Owns: separate q/k/v Linear layers <-> one `c_attn` Conv1D (concatenated on the output dim),
Linear weights [out, in] <-> Conv1D [in, out] (transposed), norm1/norm2/norm_f <-> ln_1/ln_2/ln_f,
tok_emb/pos_emb <-> wte/wpe, lm_head tied to wte (not stored), GELU(tanh) = "gelu_new", LayerNorm
eps 1e-5. No file I/O, no transformers.
"""
from __future__ import annotations

from hpctrain.errors import UserError

# ours (inside blocks.{i}.) -> (HF inside transformer.h.{i}., stored transposed)
_BLOCK = {"norm1": ("ln_1", False), "norm2": ("ln_2", False), "attn.wo": ("attn.c_proj", True),
          "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
_TOP = {"tok_emb.weight": "transformer.wte.weight", "lm_head.weight": "transformer.wte.weight",
        "pos_emb.weight": "transformer.wpe.weight", "norm_f.weight": "transformer.ln_f.weight",
        "norm_f.bias": "transformer.ln_f.bias"}


def gpt2_section(cfg: dict) -> dict:
    """The [model] section of a GPT2LMHeadModel config.json (what hpctrain's gpt2 can represent)."""
    width = cfg["n_embd"]
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"config.json: activation_function {cfg['activation_function']!r}: "
                        f"hpctrain's gpt2 uses gelu_new")
    if cfg.get("n_inner") not in (None, 4 * width) or not cfg.get("tie_word_embeddings", True):
        raise UserError("config.json: n_inner != 4 n_embd or untied embeddings: not hpctrain's gpt2")
    if abs(cfg.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        raise UserError(f"config.json: layer_norm_epsilon {cfg['layer_norm_epsilon']}: gpt2 uses 1e-5")
    return {"arch": "gpt2", "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_embd": width,
            "block_size": cfg["n_positions"], "max_positions": cfg["n_positions"],
            "vocab_size": cfg["vocab_size"]}


def gpt2_source(fqn: str, width: int) -> tuple[str, bool, int]:
    """(HF tensor, stored transposed (Conv1D), offset on its output dim) of our gpt2 parameter."""
    if fqn in _TOP:
        return _TOP[fqn], False, 0
    _, layer, rest = fqn.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    hf = f"transformer.h.{layer}."
    if module in ("attn.wq", "attn.wk", "attn.wv"):  # one c_attn, q | k | v on the output dim
        return hf + "attn.c_attn." + kind, True, "qkv".index(module[-1]) * width
    if module not in _BLOCK:
        raise UserError(f"parameter {fqn!r}: not a parameter of hpctrain's gpt2")
    name, transposed = _BLOCK[module]
    return hf + f"{name}.{kind}", transposed, 0


def to_hf_gpt2(sd: dict, m: dict) -> tuple[dict, dict]:
    """(HF GPT-2 state dict, config.json dict) from our model's state dict and config (meta
    tensors give the shapes HF's tensors have: what init.from checks a folder against)."""
    import torch

    def get(name):
        if name not in sd:
            raise UserError(f"checkpoint lacks model.{name} (not an hpctrain GPT?)")
        return sd[name].float()

    out = {"transformer.wte.weight": get("tok_emb.weight"),
           "transformer.wpe.weight": get("pos_emb.weight"),
           "transformer.ln_f.weight": get("norm_f.weight"),
           "transformer.ln_f.bias": get("norm_f.bias")}
    for i in range(m["n_layer"]):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[hf + b + ".weight"], out[hf + b + ".bias"] = get(ours + a + ".weight"), get(ours + a + ".bias")
        qkv = [ours + f"attn.{w}" for w in ("wq", "wk", "wv")]
        out[hf + "attn.c_attn.weight"] = torch.cat([get(n + ".weight") for n in qkv], 0).t()
        out[hf + "attn.c_attn.bias"] = torch.cat([get(n + ".bias") for n in qkv], 0)
        for a, b in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[hf + b + ".weight"] = get(ours + a + ".weight").t()
            out[hf + b + ".bias"] = get(ours + a + ".bias")
    out = {k: v.contiguous() for k, v in out.items()}
    positions = m.get("max_positions") or m["block_size"]  # wpe's rows, all of them
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": m["vocab_size"], "n_positions": positions, "n_ctx": positions,
        "n_embd": m["n_embd"], "n_layer": m["n_layer"], "n_head": m["n_head"], "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "torch_dtype": "float32",
    }
    return out, config


# ---- the HFSpec functions (hpctrain/model/spec.py) ------------------------------------------
def section_from_config(cfg: dict) -> dict:
    """config.json -> the [model] keys (HFSpec)."""
    return gpt2_section(cfg)


def export(state: dict, section: dict) -> tuple[dict, dict]:
    """(HF GPT2LMHeadModel state dict, config.json) of a checkpoint's tensors (HFSpec)."""
    return to_hf_gpt2(state, section)


def source_of(fqn: str, section: dict) -> tuple[str, bool, int]:
    """The HF tensor init.from reads our parameter from (HFSpec)."""
    return gpt2_source(fqn, section["n_embd"])


def alias(name: str, section: dict) -> tuple[str, bool] | None:
    """A folder's names without the "transformer." prefix (GPT2Model's own save) are the same
    tensors; lm_head.weight is a tied copy of wte (HFSpec)."""
    if name == "lm_head.weight":
        return "transformer.wte.weight", False
    return "transformer." + name, True
