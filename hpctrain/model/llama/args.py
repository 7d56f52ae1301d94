"""The [model] keys of model.arch = "llama" (Llama 2/3/3.1, Mistral, Qwen2; with MoE keys Mixtral,
Qwen2-MoE), their rules and the SwiGLU width rule. It must never import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.model.moe_args import MoEArgs, check_moe


@dataclass
class _DenseArgs:
    n_kv_head: int = field(default=0, metadata={
        "help": "llama: key/value heads (grouped-query attention; must divide n_head; 0 = n_head)"})
    rope_theta: float = field(default=10000.0, metadata={"help": "llama: rotary base (Llama 3: 500000)"})
    rope_scaling_factor: float = field(default=0.0, metadata={
        "help": "llama: Llama-3.1 rotary frequency scaling ('llama3' rope_type) factor, e.g. 8 (0 = off)"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "llama: rope scaling low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "llama: rope scaling high_freq_factor"})
    rope_original_max_positions: int = field(default=8192, metadata={
        "help": "llama: rope scaling original_max_position_embeddings"})
    ffn_hidden: int = field(default=0, metadata={
        "help": "llama: SwiGLU hidden width (0 = Llama's rule: int(8 n_embd / 3) x ffn_dim_multiplier "
                "rounded up to a multiple of multiple_of)"})
    multiple_of: int = field(default=256, metadata={"help": "llama: see ffn_hidden (Llama 3: 1024)"})
    ffn_dim_multiplier: float = field(default=1.0, metadata={"help": "llama: see ffn_hidden (Llama 3: 1.3)"})
    rms_norm_eps: float = field(default=1e-5, metadata={"help": "llama: RMSNorm epsilon"})
    qkv_bias: bool = field(default=False, metadata={"help": "llama: bias on q/k/v (Qwen2: true)"})
    tie_embeddings: bool = field(default=False, metadata={
        "help": "llama: the head shares the embedding's weight (gpt2 always ties)"})


@dataclass
class LlamaArgs(MoEArgs, _DenseArgs):
    """llama's keys: the dense ones, then the mixture-of-experts ones (model/moe_args.py)."""


def llama_ffn_hidden(n_embd: int, ffn_hidden: int, multiple_of: int, ffn_dim_multiplier: float) -> int:
    """llama's SwiGLU width: ffn_hidden, or Llama's rule (Meta's reference model.py): 2/3 of
    4 n_embd, times ffn_dim_multiplier, rounded up to a multiple of multiple_of."""
    if ffn_hidden:
        return ffn_hidden
    hidden = int(2 * 4 * n_embd / 3)
    if ffn_dim_multiplier != 1.0:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_width(m) -> int:
    """The SwiGLU width of `m` (any object with llama's keys)."""
    return llama_ffn_hidden(m.n_embd, m.ffn_hidden, m.multiple_of, m.ffn_dim_multiplier)


def check_config(m, check) -> None:
    """Ranges, grouped-query attention, rotary head size, the MoE keys."""
    kv = m.n_kv_head or m.n_head
    check(m.n_kv_head >= 0 and m.n_head % kv == 0, "model.n_kv_head",
          f"{m.n_kv_head} must divide model.n_head={m.n_head} (grouped-query attention; 0 = n_head)")
    check((m.n_embd // m.n_head) % 2 == 0, "model.n_head",
          f"head size n_embd / n_head = {m.n_embd // m.n_head} must be even (rotary embeddings)")
    check(m.rope_theta > 0, "model.rope_theta", f"{m.rope_theta}: must be > 0")
    check(m.rope_scaling_factor >= 0, "model.rope_scaling_factor", "must be >= 0 (0 = off)")
    check(m.rope_scaling_factor == 0 or m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
          "model.rope_high_freq_factor", f"{m.rope_high_freq_factor} must be > "
          f"model.rope_low_freq_factor={m.rope_low_freq_factor} > 0")
    check(m.rope_original_max_positions >= 1, "model.rope_original_max_positions", "must be >= 1")
    check_moe(m, check)
    check(m.ffn_hidden >= 0, "model.ffn_hidden", "must be >= 0 (0 = Llama's rule)")
    check(m.multiple_of >= 1, "model.multiple_of", "must be >= 1")
    check(m.ffn_dim_multiplier > 0, "model.ffn_dim_multiplier", "must be > 0")
    check(m.rms_norm_eps > 0, "model.rms_norm_eps", "must be > 0")


def check_tp(m, tp: int, check) -> None:
    """Each tp rank holds n_kv_head / tp key/value heads and ffn / tp of the SwiGLU width."""
    check((m.n_kv_head or m.n_head) % tp == 0, "parallel.tp",
          f"tp={tp} must divide model.n_kv_head={m.n_kv_head or m.n_head} (each rank holds "
          f"n_kv_head / tp key/value heads)")
    hidden = ffn_width(m)
    check(hidden % tp == 0, "parallel.tp",
          f"tp={tp} must divide the SwiGLU width {hidden} (model.ffn_hidden, or Llama's rule from "
          f"model.multiple_of)")
