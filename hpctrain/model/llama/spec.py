"""model.arch = "llama" (Llama 2/3/3.1, Mistral, Qwen2; with experts Mixtral, Qwen2-MoE): its
registration (ModelSpec), tensor-parallel plan and planner arithmetic.

Torch-free (config, plan and --help import it); the modules are model.py, the Hugging Face
adapter hf.py, the keys and their rules args.py.
"""
from __future__ import annotations

from hpctrain.model import moe_args
from hpctrain.model.llama import args
from hpctrain.model.spec import HFSpec, ModelSpec, register


def block_tp_plan(m, layer: int) -> dict[str, str]:
    """q/k/v column-parallel (n_head / tp and n_kv_head / tp heads, rotary inside), wo row-parallel;
    SwiGLU gate / up column-parallel, proj row-parallel; a sparse layer's MoE not split over tp."""
    attn = {"attn": "gather", "attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise",
            "attn.wo": "rowwise", "norm1": "norm", "norm2": "norm"}
    if moe_args.is_sparse(m, layer):
        return {**attn, "mlp": "experts"}
    return {**attn, "mlp": "gather", "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.proj": "rowwise"}


class Shape:
    """Llama's parameter counts for the planner (plan/shape.py's ModelShape `s`): RMSNorms (weight
    only), rotary positions (no table), grouped-query attention (wk, wv are C x n_kv_head *
    head_dim), a SwiGLU MLP (gate, up, proj: 3 C F, F by args.llama_ffn_hidden), optional q/k/v
    bias, tied or untied head; MoE layers' extra parameters are plan/moe.py's."""
    llama_style = True      # RMSNorm / SwiGLU / rotary activations (plan/memory.py's formula)

    def kv_heads(self, s) -> int:
        return s.n_kv_head or s.n_head

    def kv_dim(self, s) -> int:
        """Width of the k and v projections: kv heads x head_dim."""
        return self.kv_heads(s) * (s.n_embd // s.n_head)

    def ffn(self, s) -> int:
        return args.ffn_width(s)

    def tied(self, s) -> bool:
        return s.tie_embeddings

    def block_matmul_params(self, s) -> int:
        c = s.n_embd
        return 2 * c * c + 2 * c * s.kv_dim + 3 * c * s.ffn

    def _qkv_bias(self, s) -> int:
        return s.n_embd + 2 * s.kv_dim if s.qkv_bias else 0

    def block_params(self, s) -> int:
        """The matmuls + q/k/v biases if any + 2 RMSNorm weights."""
        return self.block_matmul_params(s) + self._qkv_bias(s) + 2 * s.n_embd

    def position_params(self, s) -> int:
        return 0

    def norm_f_params(self, s) -> int:
        return s.n_embd

    def num_params(self, s) -> int:
        """Llama.num_params: without the input embedding when the head is untied (a lookup)."""
        return s.total_params() - (0 if s.tied else s.embedding_params)

    def named_params(self, s) -> int:
        """What the model is called by: every parameter (Meta's 8.03B / 70.55B count the input
        embedding)."""
        return s.total_params()

    def block_params_tp(self, s, tp: int) -> int:
        """Column-parallel q/k/v, gate, up (and q/k/v biases) / tp, row-parallel wo, proj / tp,
        norms replicated."""
        return (self.block_matmul_params(s) + self._qkv_bias(s)) // tp + 2 * s.n_embd

    def position_params_tp(self, s, tp: int) -> int:
        return 0

    def tp_problem(self, s, tp: int) -> str | None:
        if s.kv_heads % tp:
            return f"must divide n_kv_head {s.kv_heads} (each rank holds n_kv_head / tp key/value heads)"
        if s.ffn % tp:
            return f"must divide the SwiGLU width {s.ffn} (model.ffn_hidden)"
        return None

    def describe(self, s, fmt_params, sparse_layers: int) -> str:
        """The plan's one-line name of the model (`sparse_layers`: its MoE layers)."""
        experts = (f", {s.moe_experts} experts top {s.moe_top_k} in {sparse_layers} layers"
                   if s.moe_experts else "")
        active = f" ({fmt_params(s.active_params())} active: MFU's N)" if s.moe_experts else ""
        return (f"llama {s.n_layer} x {s.n_embd} ({s.n_head} heads, {s.kv_heads} kv heads, ffn {s.ffn}"
                f"{experts}, vocab {s.vocab_size}, {'tied' if s.tied else 'untied'}, block {s.block_size}), "
                f"{fmt_params(self.named_params(s))} parameters{active}")


SPEC = register(ModelSpec(
    name="llama",
    summary="RMSNorm, rotary positions, SwiGLU, grouped-query attention: Llama 2/3, Mistral, "
            "Qwen2; with model.moe_experts Mixtral, Qwen2-MoE",
    args=args.LlamaArgs,
    module="hpctrain.model.llama.model",
    check_config=args.check_config,
    check_tp=args.check_tp,
    block_tp_plan=block_tp_plan,
    shape=Shape(),
    hf=HFSpec(model_types=("llama", "mistral", "qwen2", "mixtral", "qwen2_moe"),
              module="hpctrain.model.llama.hf",
              config_json_keys={"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
                                "vocab_size": "vocab_size", "ffn_hidden": "intermediate_size",
                                "block_size": "max_position_embeddings",
                                "max_positions": "max_position_embeddings",
                                "moe_experts": "num_local_experts / num_experts",
                                "moe_expert_hidden": "intermediate_size / moe_intermediate_size",
                                "moe_shared_hidden": "shared_expert_intermediate_size"},
              architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                             "MixtralForCausalLM", "Qwen2MoeForCausalLM"),
              export_words="for 'llama' Llama, Qwen2 (qkv_bias), Mixtral (moe_experts) or "
                           "Qwen2-MoE (a gated shared expert)"),
    n_experts=moe_args.n_experts,
))
