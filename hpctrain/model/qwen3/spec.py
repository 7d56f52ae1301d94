"""model.arch = "qwen3" (Qwen3; with model.moe_experts Qwen3-MoE): its registration (ModelSpec),
tensor-parallel plan and planner arithmetic.

Torch-free (config, plan and --help import it); the modules are model.py, the Hugging Face adapter
hf.py, the keys and their rules args.py.

Tensor parallelism: Llama's plan (colwise wq/wk/wv and SwiGLU gate/up, rowwise wo/proj, a sparse
layer's MoE replicated over tp and run on this rank's tokens) plus the per-head q/k norms, style
"partial": under colwise wq / wk a rank holds n_head / tp query and n_kv_head / tp key heads and
q_norm / k_norm run over each of them; their weights [head_dim] are shared by every head, so a
rank's gradient is its own heads' part, summed over tp after backward (with and without
parallel.sp: the heads are split either way).

Planner (plan/shape.py's ModelShape `s`): a block is wq [q, C], wk / wv [kv, C], wo [C, q] (q =
n_head x head_dim, kv = n_kv_head x head_dim: the head width is its own), q_norm / k_norm
[head_dim], two RMSNorms [C] and a dense SwiGLU 3 C F (a sparse layer's feed-forward: plan/moe.py);
no position table; lm_head untied unless tie_embeddings.
"""
from __future__ import annotations

from hpctrain.model import moe_args
from hpctrain.model.qwen3 import args
from hpctrain.model.llama.spec import Shape as LlamaShape
from hpctrain.model.spec import HFSpec, ModelSpec, register


def block_tp_plan(m, layer: int) -> dict[str, str]:
    """Llama's block plan + the q/k norms over the local heads ("partial")."""
    attn = {"attn": "gather", "attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise",
            "attn.wo": "rowwise", "attn.q_norm": "partial", "attn.k_norm": "partial",
            "norm1": "norm", "norm2": "norm"}
    if moe_args.is_sparse(m, layer):
        return {**attn, "mlp": "experts"}
    return {**attn, "mlp": "gather", "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.proj": "rowwise"}


class Shape(LlamaShape):
    """Qwen3's parameter counts, FLOPs and activations for the planner (module docstring)."""

    def kv_dim(self, s) -> int:
        """k / v width: n_kv_head x head_dim (not n_embd / n_head: the head width is its own)."""
        return args.kv_dim(s)

    def attention_width(self, s) -> int:
        """n_head x head_dim: the scores' and values' width in the FLOPs (12 L q T)."""
        return args.q_dim(s)

    def ffn(self, s) -> int:
        return args.ffn_width(s)

    def block_matmul_params(self, s) -> int:
        c = s.n_embd
        return 2 * c * args.q_dim(s) + 2 * c * args.kv_dim(s) + 3 * c * args.ffn_width(s)

    def block_params(self, s) -> int:
        """The matmuls + 2 RMSNorm weights [C] + the q/k norms' [head_dim] each."""
        return self.block_matmul_params(s) + 2 * s.n_embd + 2 * args.head_width(s)

    def block_params_tp(self, s, tp: int) -> int:
        """Column-parallel q/k/v, gate, up / tp, row-parallel wo, proj / tp, norms (the q/k ones
        too) replicated."""
        return self.block_matmul_params(s) // tp + 2 * s.n_embd + 2 * args.head_width(s)

    def tp_problem(self, s, tp: int) -> str | None:
        if (s.n_kv_head or s.n_head) % tp:
            return f"must divide n_kv_head {s.n_kv_head or s.n_head} (each rank holds n_kv_head / tp key/value heads)"
        if args.ffn_width(s) % tp:
            return f"must divide the dense SwiGLU width {args.ffn_width(s)} (model.ffn_hidden)"
        return None

    def layer_activation_bytes(self, s, micro_batch: int, tp: int, half: bool) -> int:
        """The largest block's stored activations for one micro-batch (plan/memory.py counts one
        figure per block): a sparse one's when the model has one, else a dense one's."""
        sparse = args.n_sparse_layers(s)
        kinds = [False] * (sparse < s.n_layer) + [True] * (sparse > 0)
        return max(self.block_activation_bytes(s, micro_batch, tp, half, sparse) for sparse in kinds)

    def block_activation_bytes(self, s, micro_batch: int, tp: int, half: bool, sparse: bool) -> int:
        """One block's stored activations for one micro-batch: Llama's count
        (plan/memory.llama_layer_bytes) with the query-wide tensors (SDPA's rotated q and its
        output) at the query width, the q/k norms' fp32 input and normalized copy (8 (q + kv)),
        and in a sparse layer the SwiGLU terms over the top_k routed rows (k H per token instead
        of F) plus the routing: the dispatched rows and the experts' fp32 outputs (k C each), the
        router's fp32 scores (4 E), three int64 row indices (24 k). Within 2% of what autograd
        saves for a fp32 block (tests/unit/test_qwen3.py)."""
        b, h, q, kv = micro_batch, s.n_embd, args.q_dim(s), args.kv_dim(s)
        whole, rest, kv_bytes, mlp = (10, 20, 4, 8) if half else (8, 24, 8, 16)
        q_bytes = 4 if half else 8                    # rotated q + SDPA output, per query column
        k = s.moe_top_k
        f = k * (s.moe_expert_hidden or args.ffn_width(s)) if sparse else args.ffn_width(s)
        routing = ((2 if half else 4) + 4) * k * h + 4 * s.moe_experts + 24 * k if sparse else 0
        sharded = ((rest - q_bytes) * h + q_bytes * q + kv_bytes * kv + mlp * f + routing
                   + 8 * (q + kv) + 4 * s.n_head + 8)
        t = s.block_size
        return t * b * whole * h + t * b * sharded // tp + 2 * t * args.head_width(s) * (2 if half else 4)

    def describe(self, s, fmt_params, sparse_layers: int) -> str:
        """The plan's one-line name of the model (`sparse_layers`: its MoE layers)."""
        experts = (f", {s.moe_experts} experts of {s.moe_expert_hidden or args.ffn_width(s)} top "
                   f"{s.moe_top_k} in {sparse_layers} layers" if s.moe_experts else "")
        active = f" ({fmt_params(s.active_params())} active: MFU's N)" if s.moe_experts else ""
        return (f"qwen3 {s.n_layer} x {s.n_embd} ({s.n_head} heads of {args.head_width(s)}, "
                f"{s.kv_heads} kv heads, ffn {s.ffn}{experts}, vocab {s.vocab_size}, "
                f"{'tied' if s.tied else 'untied'}, block {s.block_size}), "
                f"{fmt_params(self.named_params(s))} parameters{active}")


SPEC = register(ModelSpec(
    name="qwen3",
    summary="Qwen3: llama's block with per-head q/k RMSNorm, head_dim of its own, no q/k/v bias; "
            "with model.moe_experts Qwen3-MoE (softmax top-k, no shared expert)",
    args=args.Qwen3Keys,
    module="hpctrain.model.qwen3.model",
    check_config=args.check_config,
    check_tp=args.check_tp,
    block_tp_plan=block_tp_plan,
    shape=Shape(),
    hf=HFSpec(model_types=("qwen3", "qwen3_moe"), module="hpctrain.model.qwen3.hf",
              config_json_keys={"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
                                "n_kv_head": "num_key_value_heads", "head_dim": "head_dim",
                                "vocab_size": "vocab_size", "ffn_hidden": "intermediate_size",
                                "block_size": "max_position_embeddings",
                                "max_positions": "max_position_embeddings",
                                "moe_experts": "num_experts", "moe_expert_hidden": "moe_intermediate_size",
                                "moe_first_dense": "mlp_only_layers"},
              architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
              export_words="for 'qwen3' Qwen3 or Qwen3-MoE (moe_experts)"),
    n_experts=moe_args.n_experts,
))
