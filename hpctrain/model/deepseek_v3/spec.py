"""model.arch = "deepseek_v3": its registration (ModelSpec), tensor-parallel plan and planner
arithmetic. Torch-free (config, plan and --help import it); the keys and rules are args.py, the
modules model.py, the Hugging Face adapter hf.py; MLA's tensor-parallel styles (gather_local,
replicate, replicate_sum_grad) are parallel/tensor_parallel.py's.

The planner's arithmetic (`Shape`: methods taking plan/shape.py's ModelShape `s`): the feed-forward
is Llama's, a dense SwiGLU of ffn_hidden (0: 4 n_embd) counted in every block, the sparse layers'
extra (routed experts, shared experts as one SwiGLU, no shared gate, every layer from
moe_first_dense on sparse) plan/moe.py's. Per block: q = q_a [r_q, C] + q_norm [r_q] + q_b
[H qk, r_q] (or wq [H qk, C]), kv_a [r_kv, C], k_rope [rope, C], kv_norm [r_kv], kv_b
[H (nope + v), r_kv], wo [C, H v], 2 RMSNorms, SwiGLU 3 C F. Under tp q_b / wq, kv_b, wo and the
SwiGLU are split, the low-rank projections and their norms replicated. `flops_per_token`,
`block_matmul_params_tp` and `layer_activation_bytes` are MLA's own, beyond what plan/shape.py
asks of a family today (its generic ones assume q/k/v of width n_embd, every matmul split over tp).
"""
from __future__ import annotations

from hpctrain.model import moe_args
from hpctrain.model.deepseek_v3 import args
from hpctrain.model.deepseek_v3.args import ffn_width, tp_problem
from hpctrain.model.llama.spec import Shape as LlamaShape
from hpctrain.model.spec import HFSpec, ModelSpec, register


def block_tp_plan(m, layer: int) -> dict[str, str]:
    """{submodule of block `layer`: style} for a config `m` of this family."""
    latents = ("q_a", "q_norm", "kv_a", "kv_norm") if m.q_lora_rank else ("kv_a", "kv_norm")
    plan = {"attn": "gather_local", **{f"attn.{name}": "replicate" for name in latents},
            "attn.k_rope": "replicate_sum_grad", "attn.q_b" if m.q_lora_rank else "attn.wq": "colwise",
            "attn.kv_b": "colwise", "attn.wo": "rowwise", "norm1": "norm", "norm2": "norm"}
    if m.moe_experts and layer >= m.moe_first_dense:
        return {**plan, "mlp": "experts"}
    return {**plan, "mlp": "gather", "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.proj": "rowwise"}


def qk_head_dim(s) -> int:
    return s.qk_nope_head_dim + s.qk_rope_head_dim


def attention_split(s) -> int:
    """q_b (or wq), kv_b, wo: the heads' matrices, split over tp."""
    c, h = s.n_embd, s.n_head
    return (h * qk_head_dim(s) * (s.q_lora_rank or c) + h * (s.qk_nope_head_dim + s.v_head_dim) * s.kv_lora_rank
            + h * s.v_head_dim * c)


def attention_whole(s) -> int:
    """q_a, kv_a, k_rope: the low-rank projections, replicated over tp."""
    return s.n_embd * (s.q_lora_rank + s.kv_lora_rank + s.qk_rope_head_dim)


class Shape(LlamaShape):
    llama_style = True      # RMSNorm / SwiGLU / rotary activations (plan/memory.py's formula)

    def kv_heads(self, s) -> int:
        return s.n_head

    def kv_dim(self, s) -> int:
        """k and v per token (plan/memory.py's activation count): H qk and H v, their mean."""
        return s.n_head * (qk_head_dim(s) + s.v_head_dim) // 2

    def ffn(self, s) -> int:
        return ffn_width(s)

    def block_matmul_params(self, s) -> int:
        return attention_split(s) + attention_whole(s) + 3 * s.n_embd * ffn_width(s)

    def block_params(self, s) -> int:
        """The matmuls + the latents' two norms + 2 RMSNorm weights."""
        return self.block_matmul_params(s) + s.q_lora_rank + s.kv_lora_rank + 2 * s.n_embd

    def block_matmul_params_tp(self, s, tp: int) -> int:
        return (attention_split(s) + 3 * s.n_embd * ffn_width(s)) // tp + attention_whole(s)

    def block_params_tp(self, s, tp: int) -> int:
        """The heads' matrices and the SwiGLU / tp, the latents and every norm whole."""
        return self.block_matmul_params_tp(s, tp) + s.q_lora_rank + s.kv_lora_rank + 2 * s.n_embd

    def tp_problem(self, s, tp: int) -> str | None:
        return tp_problem(s, tp)

    def flops_per_token(self, s) -> float:
        """DeepseekV3.flops_per_token: 6N + 6 L n_head (qk + v) T, N the active parameters."""
        return 6.0 * s.active_params() + 6.0 * s.n_layer * s.n_head * (qk_head_dim(s) + s.v_head_dim) * s.block_size

    def layer_activation_bytes(self, s, micro_batch: int, tp: int, half: bool) -> int:
        """One block's saved tensors for a micro-batch, as memory.llama_layer_bytes counts llama's,
        with MLA's widths: fp32 residual input and the norms' copies (8 h whole, 8 h sharded),
        the latents and their norms' outputs (replicated), q and k (H qk each), v and the
        attention output (H v each) on a head shard, SwiGLU's four f-wide tensors, SDPA's
        logsumexp, the rope tables."""
        b, t, h, a = micro_batch, s.block_size, s.n_embd, s.n_head
        act = 2 if half else 4
        whole = 8 * h + 2 * act * (s.q_lora_rank + s.kv_lora_rank + s.qk_rope_head_dim)
        sharded = 8 * h + act * a * 2 * (qk_head_dim(s) + s.v_head_dim) + 4 * act * ffn_width(s) + 4 * a + 8
        return t * b * whole + t * b * sharded // tp + 2 * t * s.qk_rope_head_dim * act

    def describe(self, s, fmt_params, sparse_layers: int) -> str:
        """The plan's one-line name of the model."""
        experts = (f", {s.moe_experts} routed + {s.moe_shared_experts} shared experts top {s.moe_top_k} "
                   f"in {sparse_layers} layers" if s.moe_experts else "")
        active = f" ({fmt_params(s.active_params())} active: MFU's N)" if s.moe_experts else ""
        return (f"deepseek_v3 {s.n_layer} x {s.n_embd} ({s.n_head} heads, MLA q {s.q_lora_rank or '-'} / "
                f"kv {s.kv_lora_rank}, ffn {ffn_width(s)}{experts}, vocab {s.vocab_size}, "
                f"{'tied' if s.tied else 'untied'}, block {s.block_size}), "
                f"{fmt_params(self.named_params(s))} parameters{active}")


SPEC = register(ModelSpec(
    name=args.ARCH,
    summary="DeepSeek-V3-style: multi-head latent attention (compressed KV, decoupled rope, YaRN), "
            "shared + routed experts with the sigmoid group-limited router, first layers dense",
    args=args.DeepseekV3Args,
    module="hpctrain.model.deepseek_v3.model",
    check_config=args.check_config,
    check_tp=args.check_tp,
    block_tp_plan=block_tp_plan,
    shape=Shape(),
    hf=HFSpec(model_types=("deepseek_v3",), module="hpctrain.model.deepseek_v3.hf",
              config_json_keys={"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
                                "vocab_size": "vocab_size", "ffn_hidden": "intermediate_size",
                                "block_size": "max_position_embeddings",
                                "max_positions": "max_position_embeddings",
                                "moe_experts": "n_routed_experts", "moe_expert_hidden": "moe_intermediate_size"},
              architectures=("DeepseekV3ForCausalLM",),
              export_words="DeepSeek-V3 (model.arch = 'deepseek_v3')"),
    n_experts=moe_args.n_experts,
))
