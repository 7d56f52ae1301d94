"""model.arch = "gpt2": its registration (ModelSpec), tensor-parallel plan and planner arithmetic.

Torch-free (config, plan and --help import it); the modules are model.py, the Hugging Face
adapter hf.py. Owns what hpctrain needs to know of GPT-2 beyond its modules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.model.spec import HFSpec, ModelSpec, register


@dataclass
class GPT2Args:
    """gpt2 has no keys beyond the common ones (model/spec.py CommonArgs)."""


def check_config(m, check) -> None:
    """Nothing beyond the common keys' rules."""


def check_tp(m, tp: int, check) -> None:
    """Nothing beyond tp | n_head (its k/v heads are its heads) and tp | block_size."""


def block_tp_plan(m, layer: int) -> dict[str, str]:
    """Megatron's: q/k/v and fc column-parallel, wo and proj row-parallel, LayerNorms sequence-parallel."""
    return {"attn": "gather", "attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise",
            "attn.wo": "rowwise", "norm1": "norm", "norm2": "norm",
            "mlp": "gather", "mlp.fc": "colwise", "mlp.proj": "rowwise"}


def undecayed(m) -> tuple[str, ...]:
    """The position table's rows past block_size get no gradient: decay alone would shrink them
    toward 0, so an export would lose the positions an init.from folder had beyond the training
    length (model/optim.py)."""
    return ("pos_emb.weight",) if m.max_positions > m.block_size else ()


class Shape:
    """GPT-2's parameter counts for the planner (plan/shape.py's ModelShape `s`): LayerNorms with
    bias, learned positions, a 4C GELU MLP, tied embedding / head."""
    llama_style = False     # LayerNorm / GELU activations (plan/memory.py's formula)

    def kv_heads(self, s) -> int:
        return s.n_head

    def kv_dim(self, s) -> int:
        """Width of the k and v projections: kv heads x head_dim."""
        return self.kv_heads(s) * (s.n_embd // s.n_head)

    def ffn(self, s) -> int:
        return 4 * s.n_embd

    def tied(self, s) -> bool:
        return True

    def block_matmul_params(self, s) -> int:
        c = s.n_embd
        return 2 * c * c + 2 * c * s.kv_dim + 2 * c * s.ffn

    def block_params(self, s) -> int:
        """The matmuls + their biases + 2 LayerNorms: 12 C^2 + 13 C."""
        c = s.n_embd
        return 12 * c * c + 13 * c

    def position_params(self, s) -> int:
        return s.positions * s.n_embd

    def norm_f_params(self, s) -> int:
        return 2 * s.n_embd

    def num_params(self, s) -> int:
        """GPT.num_params: without the position table."""
        return s.total_params() - s.position_params

    def named_params(self, s) -> int:
        """What the model is called by (plan's report): num_params."""
        return s.num_params()

    def block_params_tp(self, s, tp: int) -> int:
        """Column-parallel q/k/v/fc (weights, biases / tp), row-parallel wo/proj (weights / tp,
        biases replicated), LayerNorms replicated."""
        c = s.n_embd
        return (12 * c * c + 7 * c) // tp + 2 * c + 4 * c

    def position_params_tp(self, s, tp: int) -> int:
        return math.ceil(s.positions / tp) * s.n_embd

    def tp_problem(self, s, tp: int) -> str | None:
        return None

    def describe(self, s, fmt_params, sparse_layers: int) -> str:
        """The plan's one-line name of the model."""
        return (f"{s.n_layer} x {s.n_embd} ({s.n_head} heads, vocab {s.vocab_size}, block "
                f"{s.block_size}), {fmt_params(s.num_params())} parameters")


SPEC = register(ModelSpec(
    name="gpt2",
    summary="LayerNorm, learned positions, GELU, tied embeddings",
    args=GPT2Args,
    module="hpctrain.model.gpt2.model",
    check_config=check_config,
    check_tp=check_tp,
    block_tp_plan=block_tp_plan,
    shape=Shape(),
    hf=HFSpec(model_types=("gpt2",), module="hpctrain.model.gpt2.hf",
              config_json_keys={"n_layer": "n_layer", "n_embd": "n_embd", "vocab_size": "vocab_size",
                                "block_size": "n_positions", "max_positions": "n_positions"},
              architectures=("GPT2LMHeadModel",), export_words="GPT-2 (model.arch = 'gpt2')"),
    undecayed=undecayed,
))
