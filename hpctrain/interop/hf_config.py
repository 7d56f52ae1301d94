"""An init.from folder's config.json, read and checked in one place: every field hpctrain reads has
the JSON type and range it must have (positive integers, positive finite numbers, booleans,
strings, objects), so a hand-edited or damaged file is one line naming the field, never a
ZeroDivisionError or TypeError later on.

Owns: reading the file (a JSON object) and the table of field rules. Which fields a family needs
and what they mean belong to the families' adapters (hpctrain/model/<arch>/hf.py) (a missing one: their
KeyError, named by hf_import.model_section). No transformers, no weights.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from hpctrain.errors import ConfigError

ROPE_OBJECTS = ("rope_scaling", "rope_parameters")  # rope settings: ROPE_RULES inside


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _int_from(low: int, null: bool = False):
    return lambda v: (null and v is None) or (_is_int(v) and v >= low)


def _positive_number(null: bool = False):
    return lambda v: (null and v is None) or (_is_number(v) and v > 0)


# (fields, test, what the value must be): every config.json field hpctrain reads
RULES = (
    (("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
      "max_position_embeddings", "n_layer", "n_head", "n_embd", "n_positions", "num_local_experts",
      "num_experts", "num_experts_per_tok", "moe_intermediate_size",
      "shared_expert_intermediate_size", "decoder_sparse_step"), _int_from(1), "an integer >= 1"),
    (("num_key_value_heads", "head_dim", "n_inner"), _int_from(1, null=True),
     "an integer >= 1 or null"),
    (("sliding_window",), _int_from(0, null=True), "an integer >= 0 or null"),
    (("rms_norm_eps", "layer_norm_epsilon"), _positive_number(), "a finite number > 0"),
    (("rope_theta",), _positive_number(null=True), "a finite number > 0 or null"),
    (("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob"),
     lambda v: isinstance(v, bool), "true or false"),
    (("model_type", "hidden_act", "activation_function"), lambda v: isinstance(v, str), "a string"),
    (("mlp_only_layers",), lambda v: isinstance(v, list), "a list"),
    (ROPE_OBJECTS, lambda v: v is None or isinstance(v, dict), "a JSON object or null"),
)
# the fields of a rope settings object (rope_scaling / rope_parameters)
ROPE_RULES = (
    (("rope_theta", "factor", "low_freq_factor", "high_freq_factor"), _positive_number(),
     "a finite number > 0"),
    (("original_max_position_embeddings",), _int_from(1), "an integer >= 1"),
)


def read_hf_config(folder: str | Path) -> dict:
    """config.json of an init.from folder, checked (`check_config`)."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config key 'init.from': {path} not found (a Hugging Face model folder "
                          f"holds config.json and model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'init.from': {path}: cannot read it as JSON ({e})") from None
    check_config(cfg, path)
    return cfg


def _first_problem(obj: dict, rules, prefix: str = "") -> tuple[str, object, str] | None:
    """(field, value, what it must be) of obj's first field that breaks `rules`, or None."""
    for key, value in obj.items():
        for fields, test, must in rules:
            if key in fields and not test(value):
                return prefix + key, value, must
        if not prefix and key in ROPE_OBJECTS and isinstance(value, dict):
            found = _first_problem(value, ROPE_RULES, f"{key}.")
            if found is not None:
                return found
    return None


def check_config(cfg, path: Path) -> None:
    """ConfigError naming config.json and its first field of the wrong type or range."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config key 'init.from': {path}: not a JSON object "
                          f"(a Hugging Face config.json is one)")
    found = _first_problem(cfg, RULES)
    if found is not None:
        field, value, must = found
        raise ConfigError(f"config key 'init.from': {path}: '{field}' is {json.dumps(value)[:40]}: "
                          f"must be {must}; fix config.json")
