"""GPT architecture only: pre-norm decoder blocks, causal self-attention, tied embeddings.

Owns: the modules, their parameter names, initialization, the forward pass, a FLOP estimate and
`generate` (greedy / sampled decoding: hpctrain/model/sampling.py). It must never import
distributed, checkpoint or data code: parallelism (DDP, FSDP, tensor and pipeline parallel) is
applied from outside by `hpctrain.parallel`.

Design choices that keep later work cheap:
- q, k, v are separate Linear layers (column-parallel TP shards them per head without reshuffling);
- blocks live in a ModuleDict keyed "0".."L-1", so a pipeline stage can drop blocks and keep the
  original parameter names (checkpoints stay layout-free);
- GELU(tanh), LayerNorm with bias and learned positions match GPT-2, so export to Hugging Face
  GPT-2 is a renaming (q/k/v concatenated into c_attn, Linear weights transposed for Conv1D).
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.attention import causal_attention


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    dropout: float = 0.0
    max_positions: int = 0  # rows of the position table (0: block_size); only the first block_size are used

    @property
    def positions(self) -> int:
        return self.max_positions or self.block_size


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.attend = causal_attention  # the attention kernel; parallel/ may swap it (context parallelism)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; doc_ids [B, T]: attention inside each document (model/attention.py);
        positions: unused here (GPT-2's positions are learned, added in GPT.embed)."""
        b, t, _ = x.shape
        # -1 instead of n_head: under tensor parallelism each rank holds n_head / tp heads.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = self.attend(q, k, v, doc_ids, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # keywords: a tensor-parallel plan prepares attn's positional input only
        x = x + self.attn(self.norm1(x), doc_ids=doc_ids, positions=positions)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied embeddings
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("attn.wo.weight", "mlp.proj.weight", "mlp.experts.w2", "mlp.shared.w2")):
                nn.init.normal_(p, 0.0, resid_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, vocab]. ``doc_ids`` [B, T]: each token's document
        (data.document_mask: attention never crosses a document); ``positions`` [B, T]: each
        token's position in its document (data.document_positions), else 0..T-1.

        A pipeline stage is this module with some pieces set to None (no embeddings: the input is
        the previous stage's hidden states; no head: the output is hidden states)."""
        x = self.embed(idx, positions) if self.tok_emb is not None else idx
        for block in self.blocks.values():
            x = block(x, doc_ids=doc_ids, positions=positions)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.lm_head(x) if self.lm_head is not None else x

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> the first block's input: token + learned position embeddings (of
        0..T-1, or of ``positions`` [B, T])."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device) if positions is None else positions
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weight counted once
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls plus attention scores (PaLM appendix B)."""
        c = self.cfg
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, eos_ids=()) -> torch.Tensor:
        """Append up to `max_new_tokens` tokens to `idx` ([B, T]); temperature 0 means greedy
        (hpctrain/model/sampling.py: top-k, top-p, repetition penalty and eos as transformers)."""
        from hpctrain.model.sampling import generate

        return generate(self, idx, max_new_tokens, self.cfg.block_size, temperature, top_k, top_p,
                        repetition_penalty, generator, eos_ids)


def model_config(section: dict) -> GPTConfig:
    """GPTConfig from a [model] section (other families' keys dropped)."""
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in section.items() if k in names})


def build(section: dict) -> GPT:
    """A fresh GPT (initialized from torch's global RNG) of a [model] section (ModelSpec.module)."""
    return GPT(model_config(section))
