"""Model shapes and parameter counts of hpctrain/model/gpt.py, as arithmetic (no torch).

Owns: the GPT's parameter count per piece (blocks, tied embedding / head, positions, final norm),
what one rank holds of it under tensor parallelism (DTensor plan of parallel/tensor_parallel.py)
and the presets of `hpctrain plan --preset`. The model has no grouped-query attention and a 4C
GELU MLP, so "70b" is a 70B-*shaped* model (80 x 8192): it has ~65B parameters, not Llama's 70B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0

    def check(self) -> "ModelShape":
        for key in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        return self

    # ---- parameter counts of the unsplit model (GPT.num_params) ----------------------------
    @property
    def block_params(self) -> int:
        """wq, wk, wv, wo (C x C + C each), fc (C x 4C + 4C), proj (4C x C + C), 2 LayerNorms."""
        c = self.n_embd
        return 12 * c * c + 13 * c

    @property
    def embedding_params(self) -> int:
        """tok_emb [V, C], tied to lm_head (one tensor)."""
        return self.vocab_size * self.n_embd

    @property
    def position_params(self) -> int:
        return self.block_size * self.n_embd

    @property
    def norm_f_params(self) -> int:
        return 2 * self.n_embd

    def total_params(self) -> int:
        """Every parameter, the tied weight once (GPT.num_params(non_embedding=False))."""
        return (self.n_layer * self.block_params + self.embedding_params + self.position_params
                + self.norm_f_params)

    def num_params(self) -> int:
        """GPT.num_params(): without the position table (what MFU and `train` report)."""
        return self.total_params() - self.position_params

    def flops_per_token(self) -> float:
        """GPT.flops_per_token: 6N + 12 L C T (PaLM appendix B)."""
        return 6.0 * self.num_params() + 12.0 * self.n_layer * self.n_embd * self.block_size

    # ---- one tensor-parallel rank's share ---------------------------------------------------
    def block_params_tp(self, tp: int) -> int:
        """Column-parallel wq/wk/wv/fc (weights and biases / tp), row-parallel wo/proj (weights
        / tp, biases replicated), LayerNorms replicated (SequenceParallel)."""
        c = self.n_embd
        return (12 * c * c + 7 * c) // tp + 2 * c + 4 * c

    def block_matmul_params_tp(self, tp: int) -> int:
        """The weights autocast copies to 16 bits (the six Linear weights), per tp rank."""
        return 12 * self.n_embd * self.n_embd // tp

    def embedding_params_tp(self, tp: int) -> int:
        """Vocab-parallel rows: the largest shard (uneven vocabularies round up)."""
        return math.ceil(self.vocab_size / tp) * self.n_embd

    def position_params_tp(self, tp: int) -> int:
        return math.ceil(self.block_size / tp) * self.n_embd


# n_head: head_dim 128 as GPT-3 / Llama at these widths; block_size 2048 as the windows
PRESETS = {
    "1b": ModelShape(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=2048),
    "7b": ModelShape(n_layer=32, n_embd=4096, n_head=32, vocab_size=50304, block_size=2048),
    "70b": ModelShape(n_layer=80, n_embd=8192, n_head=64, vocab_size=50304, block_size=2048),
}
