"""Model shapes and parameter counts of the model families (hpctrain/model/<arch>/), as arithmetic
(no torch).

Owns: the parameter count per piece (blocks, embedding, head, positions, final norm) of a model,
what one rank holds of it under tensor parallelism (the DTensor plan of
parallel/tensor_parallel.py), which tp the model allows (as config_rules refuses it), the presets
of `hpctrain plan --preset` and the shipped configs' batch keys of those that have one. What
differs by family comes from its ModelSpec's `shape` (model/<arch>/spec.py: gpt2's LayerNorms,
learned positions and 4C GELU MLP; llama's RMSNorms, rotary positions, grouped-query attention and
SwiGLU); the sparse layers' feed-forward and the active count of a mixture-of-experts model are
plan/moe.py's. The gpt2 "70b" preset is a 70B-*shaped* model (80 x 8192): ~65B parameters, not
Llama's 70B; llama3-8b / llama3-70b are Meta's shapes (8.03B and 70.55B parameters); mixtral-8x7b
is Mixtral's (46.70B total, 12.75B active without the input embedding).
"""
from __future__ import annotations

import dataclasses
import math

from hpctrain.model import spec as model_spec
from hpctrain.plan import moe

# Bytes of training state per parameter: fp32 weights, fp32 gradients and AdamW's fp32 m and v
# (plan/memory.py's model state, 4 + 4 + 8 in every precision), before any sharding
STATE_BYTES_PER_PARAM = 16
# The [model] keys a parameter count grows with (`ModelShape.size_key` names one)
SIZE_KEYS = ("n_layer", "n_embd", "vocab_size", "ffn_hidden", "block_size", "max_positions",
             "moe_experts", "moe_expert_hidden", "moe_shared_hidden")
_FIRST = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")  # ModelShape's positional order


class _Arithmetic:
    """ModelShape's methods: the [model] keys are its fields (every family's, at their defaults)."""

    @classmethod
    def of_model_config(cls, model) -> "ModelShape":
        """The shape of a training config's [model] (config_schema.ModelConfig)."""
        return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(cls)})

    def check(self) -> "ModelShape":
        for key in _FIRST:
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.arch not in model_spec.names():
            raise ValueError(f"model.arch {self.arch!r}: expected {' or '.join(model_spec.names())}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            raise ValueError(f"model.n_kv_head {self.n_kv_head} must divide model.n_head {self.n_head}")
        experts = model_spec.get(self.arch).n_experts(self)
        if self.moe_experts and not (experts and 1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(f"model.moe_top_k {self.moe_top_k} must be in [1, model.moe_experts="
                             f"{self.moe_experts}] (and a model.arch with experts)")
        return self

    def tp_problem(self, tp: int) -> str | None:
        """Why `train` refuses this tp for the model (config_rules), or None."""
        if self.n_head % tp:
            return f"must divide n_head {self.n_head}"
        problem = self.family.tp_problem(self, tp)
        if problem:
            return problem
        if self.block_size % tp:
            return f"must divide block_size {self.block_size} (sequence parallelism)"
        return None

    # ---- the architecture's pieces: the family's ModelSpec.shape ------------------------------
    @property
    def family(self):
        """The family's planner arithmetic (its ModelSpec's `shape`)."""
        return model_spec.get(self.arch).shape

    @property
    def llama(self) -> bool:
        """A llama-style block (RMSNorm, SwiGLU, rotary): plan/memory.py's activation formula."""
        return self.family.llama_style

    @property
    def tied(self) -> bool:
        return self.family.tied(self)

    @property
    def kv_heads(self) -> int:
        return self.family.kv_heads(self)

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections: n_kv_head x head_dim (n_embd without GQA)."""
        return self.family.kv_dim(self)

    @property
    def ffn(self) -> int:
        """MLP hidden width (gpt2: 4C; llama: SwiGLU's)."""
        return self.family.ffn(self)

    # ---- parameter counts of the unsplit model (the model's num_params) ----------------------
    @property
    def block_matmul_params(self) -> int:
        """The block's Linear weights (attention and MLP)."""
        return self.family.block_matmul_params(self)

    @property
    def block_params(self) -> int:
        """Every parameter of a dense block (its family's count)."""
        return self.family.block_params(self)

    @property
    def embedding_params(self) -> int:
        """tok_emb [V, C] (tied to lm_head: one tensor)."""
        return self.vocab_size * self.n_embd

    @property
    def head_params(self) -> int:
        """lm_head's own weight [V, C]: 0 when tied to the embedding."""
        return 0 if self.tied else self.vocab_size * self.n_embd

    @property
    def positions(self) -> int:
        """A position table's rows: model.max_positions (init.from's n_positions), else
        block_size (the training length, which may be shorter than the table)."""
        return self.max_positions or self.block_size

    @property
    def position_params(self) -> int:
        return self.family.position_params(self)

    @property
    def norm_f_params(self) -> int:
        return self.family.norm_f_params(self)

    def total_params(self) -> int:
        """Every parameter, a tied weight once (num_params(non_embedding=False))."""
        return (self.n_layer * self.block_params + self.embedding_params + self.head_params
                + self.position_params + self.norm_f_params
                + moe.n_sparse_layers(self) * moe.extra_params(self))

    def state_bytes(self) -> int:
        """The whole model's training state: STATE_BYTES_PER_PARAM x total_params() (the least any
        layout holds over all its ranks together, activations aside)."""
        return STATE_BYTES_PER_PARAM * self.total_params()

    def size_key(self) -> str:
        """The [model] key of SIZE_KEYS this shape's size grows with most: the one whose value,
        set to 1, shrinks total_params() the most (model.n_layer for a 10^9-layer typo)."""
        keys = [k for k in SIZE_KEYS if getattr(self, k) > 1]
        return min(keys, key=lambda k: dataclasses.replace(self, **{k: 1}).total_params())

    def num_params(self) -> int:
        """The model's num_params() (what MFU and `train` report: gpt2 without the position
        table, llama without the input embedding when the head is untied)."""
        return self.family.num_params(self)

    def active_params(self) -> int:
        """num_params() with the routed experts counted top_k / n_experts (the MFU's N;
        num_params() for a dense model)."""
        return self.num_params() - moe.inactive_params(self)

    def flops_per_token(self) -> float:
        """The model's flops_per_token: the family's own count where it has one (e.g. MLA's
        widths), else 6N + 12 L (n_head x head_dim) T (PaLM appendix B), N the active parameters."""
        own = getattr(self.family, "flops_per_token", None)
        if own is not None:
            return own(self)
        width = getattr(self.family, "attention_width", lambda s: s.n_embd)(self)  # n_head x head_dim
        return 6.0 * self.active_params() + 12.0 * self.n_layer * width * self.block_size

    # ---- one tensor-parallel rank's share ---------------------------------------------------
    def block_params_tp(self, tp: int) -> int:
        """A block's parameters on one tp rank (its family's plan)."""
        return self.family.block_params_tp(self, tp)

    def block_matmul_params_tp(self, tp: int) -> int:
        """The weights autocast copies to 16 bits (the block's Linear weights), per tp rank."""
        return self.block_matmul_params // tp

    def embedding_params_tp(self, tp: int) -> int:
        """Vocab-parallel rows (of tok_emb, and of an untied lm_head alike): the largest shard
        (uneven vocabularies round up)."""
        return math.ceil(self.vocab_size / tp) * self.n_embd

    def position_params_tp(self, tp: int) -> int:
        return self.family.position_params_tp(self, tp)


def _shape_class() -> type:
    """ModelShape: a frozen dataclass of every [model] key (model/spec.py's, the first five
    positional in _FIRST's order) with _Arithmetic's methods."""
    fields = {name: (name, typ, dataclasses.field(default=f.default, default_factory=f.default_factory))
              for name, typ, f in model_spec.model_fields()}
    order = [fields.pop(name) for name in _FIRST] + list(fields.values())
    cls = dataclasses.make_dataclass("ModelShape", order, bases=(_Arithmetic,), frozen=True)
    cls.__module__ = __name__
    return cls


ModelShape = _shape_class()


def _llama3(n_layer: int, n_embd: int, n_head: int) -> ModelShape:
    """Meta's Llama 3 shapes: 8 kv heads, SwiGLU rule with multiple_of 1024 x 1.3, 128,256-token
    vocabulary, untied head, 8,192-token training window, rotary base 500000."""
    return ModelShape(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=128256,
                      block_size=8192, arch="llama", n_kv_head=8, multiple_of=1024,
                      ffn_dim_multiplier=1.3, rope_theta=500000.0)


# n_head: head_dim 128 as GPT-3 / Llama at these widths; block_size 2048 as the windows
PRESETS = {
    "1b": ModelShape(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=2048),
    "7b": ModelShape(n_layer=32, n_embd=4096, n_head=32, vocab_size=50304, block_size=2048),
    "70b": ModelShape(n_layer=80, n_embd=8192, n_head=64, vocab_size=50304, block_size=2048),
    "llama3-8b": _llama3(32, 4096, 32),     # ffn 14336
    "llama3-70b": _llama3(80, 8192, 64),    # ffn 28672
    # Mixtral-8x7B: 8 experts of width 14336, top 2, 8 kv heads, vocab 32000, untied; its 32k
    # window trained here at 4096
    "mixtral-8x7b": ModelShape(n_layer=32, n_embd=4096, n_head=32, vocab_size=32000, block_size=4096,
                               arch="llama", n_kv_head=8, ffn_hidden=14336, moe_experts=8, moe_top_k=2),
}

# The presets this checkout ships a training config for: --preset takes that config's batch and
# precision keys (the Job's names), so that `--preset` and `--config` of one model plan the same
# job (tests/unit/test_plan_sbatch.py checks them against the files), and its `recommended:` line
# and --sbatch script name the config. The [parallel] layout stays the planner's default (DDP).
RECIPE = {"micro_batch": 1, "global_batch": 512, "precision": "bf16", "loss_chunk": 1024}
PRESET_CONFIGS = {"llama3-8b": ("configs/llama3_8b.toml", RECIPE),
                  "llama3-70b": ("configs/llama3_70b.toml", RECIPE)}
