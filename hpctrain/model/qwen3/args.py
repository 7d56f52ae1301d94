"""The [model] keys of model.arch = "qwen3" (dense Qwen3 and, with moe_experts, Qwen3-MoE), their
rules and what is derived from them. It must never import torch.

What sets Qwen3 apart from Llama / Qwen2 (and why it is its own family, not llama flags):
- `head_dim` is its own number, not n_embd / n_head (Qwen3-0.6B: width 1024, 16 heads of 128, so
  q is 2048 wide and wo maps 2048 -> 1024);
- q and k pass an RMSNorm over each head (weights [head_dim], shared by the heads) before rope;
- no bias on q/k/v (Qwen2 had one), none on o;
- Qwen3-MoE: softmax top-k routing, top-k gates renormalized (norm_topk_prob), no shared expert;
  sparse layers by decoder_sparse_step (moe_every) and mlp_only_layers, which must be a prefix
  [0, .., k-1] (moe_first_dense = k; every published Qwen3-MoE has none), so the shared MoE keys'
  rule (model/moe_args.py) says which layer is sparse; the dense ones keep a SwiGLU of ffn_hidden.

One arch for dense and MoE (moe_experts = 0: dense): the two share every module but the
feed-forward, the parameter names, the layouts and the HF adapter; transformers' two classes
(Qwen3ForCausalLM / Qwen3MoeForCausalLM) are chosen by moe_experts at export, as config.json's
model_type chooses at import. Keys shared with llama have llama's type and default (the
registry's rule): rope_theta 10000 and rms_norm_eps 1e-5 by default, Qwen3's configs say 1e6 and
1e-6 (init.from sets them).

Functions taking `m` accept any object with the flat [model] keys (the spec's convention).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.model import moe_args
from hpctrain.model.moe_args import MoEArgs, check_moe
from hpctrain.model.spec import CommonArgs


@dataclass
class _DenseKeys:
    n_kv_head: int = field(default=0, metadata={
        "help": "qwen3: key/value heads (num_key_value_heads; must divide n_head; 0 = n_head)"})
    head_dim: int = field(default=0, metadata={
        "help": "qwen3: each attention head's width, its own number (Qwen3-0.6B: 128 on a 1024-wide "
                "model with 16 heads); 0 = n_embd / n_head"})
    rope_theta: float = field(default=10000.0, metadata={"help": "qwen3: rotary base (Qwen3: 1000000)"})
    ffn_hidden: int = field(default=0, metadata={
        "help": "qwen3: the dense SwiGLU's width (intermediate_size; 0 = 3 x n_embd)"})
    rms_norm_eps: float = field(default=1e-5, metadata={
        "help": "qwen3: RMSNorm epsilon, the per-head q/k norms' too (Qwen3: 1e-6)"})
    tie_embeddings: bool = field(default=False, metadata={
        "help": "qwen3: the head shares the embedding's weight (Qwen3-0.6B / 1.7B / 4B: true)"})


@dataclass
class Qwen3Keys(MoEArgs, _DenseKeys):
    """qwen3's keys: the dense ones, then the mixture-of-experts ones (model/moe_args.py; Qwen3-MoE
    uses experts, top_k, expert_hidden, norm_topk_prob, aux_loss_coef, every, first_dense)."""


@dataclass
class Qwen3Args(Qwen3Keys, CommonArgs):
    """A Qwen3 model's whole config (the common keys + qwen3's), what model.py builds from."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    head_width = property(lambda self: head_width(self))
    q_dim = property(lambda self: q_dim(self))
    kv_dim = property(lambda self: kv_dim(self))
    ffn_hidden_size = property(lambda self: ffn_width(self))  # the name llama's SwiGLU reads
    expert_hidden = property(lambda self: self.moe_expert_hidden or ffn_width(self))

    def is_sparse(self, layer: int) -> bool:
        return moe_args.is_sparse(self, layer)


def head_width(m) -> int:
    """Each head's width: head_dim, or n_embd // n_head when 0."""
    return m.head_dim or m.n_embd // m.n_head


def q_dim(m) -> int:
    """wq's output / wo's input width: n_head x head width (!= n_embd in general)."""
    return m.n_head * head_width(m)


def kv_dim(m) -> int:
    return (m.n_kv_head or m.n_head) * head_width(m)


def ffn_width(m) -> int:
    """The dense SwiGLU's width: ffn_hidden, or 3 x n_embd (Qwen3-0.6B's and 8B's ratio)."""
    return m.ffn_hidden or 3 * m.n_embd


def n_sparse_layers(m) -> int:
    """How many layers are sparse, by arithmetic (n_layer may be a 10^9 typo)."""
    if not m.moe_experts:
        return 0
    return max(0, m.n_layer // m.moe_every - m.moe_first_dense // m.moe_every)


# MoE keys of model/moe_args.py that Qwen3-MoE has no counterpart for (its export could not
# reproduce them): their values must stay the defaults
_NOT_QWEN3_MOE = {"moe_shared_experts": 0, "moe_shared_hidden": 0, "moe_shared_gate": False,
                  "moe_gate": "softmax", "moe_bias_update_rate": 0.0}


def check_config(m, check) -> None:
    """Ranges, grouped-query attention, the head width, the MoE keys Qwen3-MoE has."""
    kv = m.n_kv_head or m.n_head
    check(m.n_kv_head >= 0 and m.n_head % kv == 0, "model.n_kv_head",
          f"{m.n_kv_head} must divide model.n_head={m.n_head} (grouped-query attention; 0 = n_head)")
    check(m.head_dim >= 0 and (m.head_dim or m.n_embd % m.n_head == 0), "model.head_dim",
          f"{m.head_dim}: must be >= 0, and set when model.n_embd={m.n_embd} is not a multiple of "
          f"model.n_head={m.n_head}")
    check(head_width(m) % 2 == 0, "model.head_dim", f"head width {head_width(m)} must be even "
          f"(rotary embeddings)")
    check(m.rope_theta > 0, "model.rope_theta", f"{m.rope_theta}: must be > 0")
    check(m.ffn_hidden >= 0, "model.ffn_hidden", "must be >= 0 (0 = 3 x n_embd)")
    check(m.rms_norm_eps > 0, "model.rms_norm_eps", "must be > 0")
    check_moe(m, check)
    for key, default in _NOT_QWEN3_MOE.items():
        check(getattr(m, key) == default, f"model.{key}", f"{getattr(m, key)!r}: Qwen3-MoE has no "
              f"such part (no shared expert, softmax gates, no balancing bias); use model.arch = "
              f"'llama' for it, or remove the key")


def check_tp(m, tp: int, check) -> None:
    """Each tp rank holds n_kv_head / tp key/value heads and ffn / tp of a dense SwiGLU."""
    check((m.n_kv_head or m.n_head) % tp == 0, "parallel.tp",
          f"tp={tp} must divide model.n_kv_head={m.n_kv_head or m.n_head} (each rank holds "
          f"n_kv_head / tp key/value heads)")
    check(ffn_width(m) % tp == 0, "parallel.tp",
          f"tp={tp} must divide the dense SwiGLU width {ffn_width(m)} (model.ffn_hidden)")
