"""Model shapes and parameter counts of hpctrain/model/gpt.py and llama.py, as arithmetic (no torch).

Owns: the parameter count per piece (blocks, embedding, head, positions, final norm) of each
`model.arch`, what one rank holds of it under tensor parallelism (the DTensor plan of
parallel/tensor_parallel.py), which tp the model allows (as config_rules refuses it), the
presets of `hpctrain plan --preset` and the shipped configs' batch keys of those that have one.
- gpt2: LayerNorms with bias, learned positions, a 4C GELU MLP, tied embedding / head. Its "70b"
  is a 70B-*shaped* model (80 x 8192): ~65B parameters, not Llama's 70B.
- llama: RMSNorms (weight only), rotary positions (no table), grouped-query attention (wk, wv are
  C x n_kv_head * head_dim), a SwiGLU MLP (gate, up, proj: 3 C F, F by Llama's hidden-size rule,
  config_rules.llama_ffn_hidden), optional q/k/v bias, tied or untied head. The presets
  llama3-8b / llama3-70b are Meta's shapes (8.03B and 70.55B parameters).
- llama with mixture-of-experts layers (model.moe_*): the sparse layers' feed-forward and the
  active count are plan/moe.py's; mixtral-8x7b is Mixtral's shape (46.70B total, 12.75B active
  without the input embedding).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hpctrain.config_rules import llama_ffn_hidden
from hpctrain.plan import moe

# Bytes of training state per parameter: fp32 weights, fp32 gradients and AdamW's fp32 m and v
# (plan/memory.py's model state, 4 + 4 + 8 in every precision), before any sharding
STATE_BYTES_PER_PARAM = 16
# The [model] keys a parameter count grows with (`ModelShape.size_key` names one)
SIZE_KEYS = ("n_layer", "n_embd", "vocab_size", "ffn_hidden", "block_size", "max_positions",
             "moe_experts", "moe_expert_hidden", "moe_shared_hidden")


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0
    max_positions: int = 0          # gpt2's position table rows (0 = block_size)
    arch: str = "gpt2"              # model.arch: gpt2 | llama; the keys below are llama's
    n_kv_head: int = 0              # 0 = n_head
    ffn_hidden: int = 0             # 0 = Llama's rule from multiple_of / ffn_dim_multiplier
    multiple_of: int = 256
    ffn_dim_multiplier: float = 1.0
    qkv_bias: bool = False
    tie_embeddings: bool = False    # gpt2 always ties
    moe_experts: int = 0            # mixture of experts (llama; plan/moe.py): 0 = dense
    moe_top_k: int = 2
    moe_expert_hidden: int = 0      # 0 = ffn
    moe_shared_experts: int = 0
    moe_shared_hidden: int = 0
    moe_shared_gate: bool = False
    moe_every: int = 1
    moe_first_dense: int = 0

    @classmethod
    def of_model_config(cls, model) -> "ModelShape":
        """The shape of a training config's [model] (config_schema.ModelConfig)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: getattr(model, k) for k in names})

    def check(self) -> "ModelShape":
        for key in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"model.arch {self.arch!r}: expected gpt2 or llama")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        if self.llama and (self.n_kv_head < 0 or self.n_head % self.kv_heads):
            raise ValueError(f"model.n_kv_head {self.n_kv_head} must divide model.n_head {self.n_head}")
        if self.moe_experts and not (self.llama and 1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(f"model.moe_top_k {self.moe_top_k} must be in [1, model.moe_experts="
                             f"{self.moe_experts}] (and model.arch llama)")
        return self

    def tp_problem(self, tp: int) -> str | None:
        """Why `train` refuses this tp for the model (config_rules), or None."""
        if self.n_head % tp:
            return f"must divide n_head {self.n_head}"
        if self.kv_heads % tp:
            return f"must divide n_kv_head {self.kv_heads} (each rank holds n_kv_head / tp key/value heads)"
        if self.llama and self.ffn % tp:
            return f"must divide the SwiGLU width {self.ffn} (model.ffn_hidden)"
        if self.block_size % tp:
            return f"must divide block_size {self.block_size} (sequence parallelism)"
        return None

    # ---- the architecture's pieces ----------------------------------------------------------
    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def tied(self) -> bool:
        return not self.llama or self.tie_embeddings

    @property
    def kv_heads(self) -> int:
        return (self.n_kv_head or self.n_head) if self.llama else self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections: n_kv_head x head_dim (n_embd without GQA)."""
        return self.kv_heads * (self.n_embd // self.n_head)

    @property
    def ffn(self) -> int:
        """MLP hidden width: 4C (gpt2) or SwiGLU's (llama)."""
        if not self.llama:
            return 4 * self.n_embd
        return llama_ffn_hidden(self.n_embd, self.ffn_hidden, self.multiple_of, self.ffn_dim_multiplier)

    # ---- parameter counts of the unsplit model (GPT.num_params / Llama.num_params) ---------
    @property
    def block_matmul_params(self) -> int:
        """wq, wo (C x C), wk, wv (C x kv_dim), the MLP: fc, proj (2 C F) or gate, up, proj (3 C F)."""
        c = self.n_embd
        return 2 * c * c + 2 * c * self.kv_dim + (3 if self.llama else 2) * c * self.ffn

    @property
    def block_params(self) -> int:
        """gpt2: the matmuls + their biases + 2 LayerNorms (12 C^2 + 13 C); llama: the matmuls +
        q/k/v biases if any + 2 RMSNorm weights."""
        c = self.n_embd
        if not self.llama:
            return 12 * c * c + 13 * c
        return self.block_matmul_params + self._qkv_bias + 2 * c

    @property
    def _qkv_bias(self) -> int:
        return self.n_embd + 2 * self.kv_dim if self.qkv_bias else 0

    @property
    def embedding_params(self) -> int:
        """tok_emb [V, C] (gpt2: tied to lm_head, one tensor)."""
        return self.vocab_size * self.n_embd

    @property
    def head_params(self) -> int:
        """lm_head's own weight [V, C]: 0 when tied to the embedding."""
        return 0 if self.tied else self.vocab_size * self.n_embd

    @property
    def positions(self) -> int:
        """gpt2's position table rows: model.max_positions (init.from's n_positions), else
        block_size (the training length, which may be shorter than the table)."""
        return self.max_positions or self.block_size

    @property
    def position_params(self) -> int:
        return 0 if self.llama else self.positions * self.n_embd

    @property
    def norm_f_params(self) -> int:
        return self.n_embd if self.llama else 2 * self.n_embd

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
        """The model's num_params() (what MFU and `train` report): gpt2 without the position
        table, llama without the input embedding when the head is untied (a lookup)."""
        if self.llama:
            return self.total_params() - (0 if self.tied else self.embedding_params)
        return self.total_params() - self.position_params

    def active_params(self) -> int:
        """num_params() with the routed experts counted top_k / n_experts (Llama.active_params: the
        MFU's N; num_params() for a dense model)."""
        return self.num_params() - moe.inactive_params(self)

    def flops_per_token(self) -> float:
        """The model's flops_per_token: 6N + 12 L (n_head x head_dim) T (PaLM appendix B), N the
        active parameters."""
        return 6.0 * self.active_params() + 12.0 * self.n_layer * self.n_embd * self.block_size

    # ---- one tensor-parallel rank's share ---------------------------------------------------
    def block_params_tp(self, tp: int) -> int:
        """Column-parallel wq/wk/wv/fc (gate, up) (weights and biases / tp), row-parallel wo/proj
        (weights / tp, gpt2's biases replicated), norms replicated (SequenceParallel)."""
        c = self.n_embd
        if not self.llama:
            return (12 * c * c + 7 * c) // tp + 2 * c + 4 * c
        return (self.block_matmul_params + self._qkv_bias) // tp + 2 * c

    def block_matmul_params_tp(self, tp: int) -> int:
        """The weights autocast copies to 16 bits (the block's Linear weights), per tp rank."""
        return self.block_matmul_params // tp

    def embedding_params_tp(self, tp: int) -> int:
        """Vocab-parallel rows (of tok_emb, and of an untied lm_head alike): the largest shard
        (uneven vocabularies round up)."""
        return math.ceil(self.vocab_size / tp) * self.n_embd

    def position_params_tp(self, tp: int) -> int:
        return math.ceil(self.positions / tp) * self.n_embd if not self.llama else 0


def _llama3(n_layer: int, n_embd: int, n_head: int) -> ModelShape:
    """Meta's Llama 3 shapes: 8 kv heads, SwiGLU rule with multiple_of 1024 x 1.3, 128,256-token
    vocabulary, untied head, 8,192-token training window."""
    return ModelShape(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=128256,
                      block_size=8192, arch="llama", n_kv_head=8, multiple_of=1024,
                      ffn_dim_multiplier=1.3)


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
