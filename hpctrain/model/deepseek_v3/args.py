"""The [model] keys of `model.arch = "deepseek_v3"` (DeepSeek-V3-style: multi-head latent
attention, shared + routed experts, the first layers dense), their rules, and the config the
modules read.

Owns: `DeepseekV3Args`, the family's own keys (beyond the keys every family has: n_layer, n_head,
n_embd, block_size, vocab_size, dropout, max_positions), each with its default and help; a key
another family also declares (rope_theta, ffn_hidden, rms_norm_eps, tie_embeddings, the moe_* keys)
keeps that family's type, default and meaning. `check_config` / `check_tp`: the rules, one line
naming the key. `DeepseekV3Config`: every key the modules read, frozen, with the derived widths.
Never imports torch (config, plan and --help read it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCH = "deepseek_v3"


def _key(default, help_text: str):
    return field(default=default, metadata={"help": f"deepseek_v3: {help_text}"})


@dataclass(frozen=True)
class DeepseekV3Args:
    q_lora_rank: int = _key(0, "width of the compressed query (0 = q projected in one matmul)")
    kv_lora_rank: int = _key(512, "width of the compressed key/value latent (what MLA caches)")
    qk_nope_head_dim: int = _key(128, "per-head query/key width without positions")
    qk_rope_head_dim: int = _key(64, "per-head query/key width with rotary positions (one key for all heads)")
    v_head_dim: int = _key(128, "per-head value width")
    rope_theta: float = _key(10000.0, "rotary base")
    rope_interleave: bool = _key(True, "rotary pairs (x0, x1), (x2, x3)... as DeepSeek (HF's rope_interleave)")
    rope_scaling_factor: float = _key(0.0, "YaRN context extension factor (0 = off)")
    rope_original_max_positions: int = _key(8192, "YaRN: the length the model was pretrained at")
    rope_beta_fast: float = _key(32.0, "YaRN: rotations above which frequencies are kept")
    rope_beta_slow: float = _key(1.0, "YaRN: rotations below which frequencies are divided by the factor")
    rope_mscale: float = _key(0.0, "YaRN: cos/sin scaled by mscale(f, this) / mscale(f, all_dim) (0 = unset)")
    rope_mscale_all_dim: float = _key(0.0, "YaRN: softmax scale times mscale(f, this)^2 (0 = unset)")
    ffn_hidden: int = _key(0, "the dense layers' SwiGLU width (0 = 4 n_embd)")
    rms_norm_eps: float = _key(1e-5, "RMSNorm epsilon (the latents' norms keep 1e-6, as HF)")
    tie_embeddings: bool = _key(False, "the head shares the embedding's weight")
    moe_experts: int = _key(0, "routed experts per sparse layer (0 = every layer dense)")
    moe_top_k: int = _key(2, "experts each token is routed to")
    moe_expert_hidden: int = _key(0, "each routed expert's SwiGLU width (0 = ffn_hidden)")
    moe_shared_experts: int = _key(0, "always-on experts, one SwiGLU of moe_shared_experts x the width")
    moe_first_dense: int = _key(0, "layers 0..k-1 stay dense (HF's first_k_dense_replace)")
    moe_groups: int = _key(1, "expert groups (HF's n_group): a token's experts come from the")
    moe_topk_groups: int = _key(1, "...moe_topk_groups groups whose two best scores sum highest (topk_group)")
    moe_norm_topk_prob: bool = _key(True, "renormalize the k selected gates to sum to 1")
    moe_routed_scale: float = _key(1.0, "the routed experts' output times this (routed_scaling_factor)")
    moe_aux_loss_coef: float = _key(0.0, "Switch/Mixtral load-balancing loss weight (0 = off)")
    moe_bias_update_rate: float = _key(0.0, "auxiliary-loss-free balancing bias step (0 = bias frozen)")


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(DeepseekV3Args):
    """Every key the modules read: the common ones, then the family's."""
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    dropout: float = 0.0
    max_positions: int = 0          # what export writes as max_position_embeddings (0: block_size)

    @classmethod
    def from_section(cls, section: dict) -> "DeepseekV3Config":
        """The config of a [model] section (other families' keys dropped), checked (ValueError)."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in section.items() if k in names})
        check_config(cfg, _raise)
        return cfg

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def ffn_hidden_size(self) -> int:
        """The dense layers' SwiGLU width (the name llama's SwiGLU module reads)."""
        return ffn_width(self)

    @property
    def expert_hidden(self) -> int:
        return self.moe_expert_hidden or self.ffn_hidden_size

    def is_sparse(self, layer: int) -> bool:
        return self.moe_experts > 0 and layer >= self.moe_first_dense


def ffn_width(m) -> int:
    return m.ffn_hidden or 4 * m.n_embd


def _raise(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}': {why}")


def check_config(m, check) -> None:
    """The family's rules on `m` (any object with its keys): `check(ok, key, why)`."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        check(getattr(m, key) >= 1, f"model.{key}", "must be >= 1")
    check(m.q_lora_rank >= 0, "model.q_lora_rank", "must be >= 0 (0 = no query bottleneck)")
    check(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", f"{m.qk_rope_head_dim}: must be even (rotary pairs)")
    check(m.rope_theta > 0 and m.rope_scaling_factor >= 0, "model.rope_theta",
          "rope_theta must be > 0 and rope_scaling_factor >= 0 (0 = no YaRN)")
    check(m.ffn_hidden >= 0 and m.rms_norm_eps > 0, "model.ffn_hidden", "ffn_hidden must be >= 0, rms_norm_eps > 0")
    if not m.moe_experts:
        return
    check(1 <= m.moe_top_k <= m.moe_experts, "model.moe_top_k",
          f"{m.moe_top_k}: must be in [1, model.moe_experts={m.moe_experts}]")
    check(0 <= m.moe_first_dense < m.n_layer, "model.moe_first_dense",
          f"{m.moe_first_dense}: leaves no sparse layer of model.n_layer={m.n_layer}")
    check(m.moe_groups >= 1 and m.moe_experts % m.moe_groups == 0, "model.moe_groups",
          f"{m.moe_groups}: must divide model.moe_experts={m.moe_experts}")
    check(1 <= m.moe_topk_groups <= m.moe_groups, "model.moe_topk_groups",
          f"{m.moe_topk_groups}: must be in [1, model.moe_groups={m.moe_groups}]")
    check(m.moe_groups == 1 or m.moe_experts // m.moe_groups >= 2, "model.moe_groups",
          f"{m.moe_groups}: a group is scored by its 2 best experts, so each needs >= 2")
    check(m.moe_aux_loss_coef >= 0 and m.moe_bias_update_rate >= 0, "model.moe_aux_loss_coef",
          "moe_aux_loss_coef and moe_bias_update_rate must be >= 0 (0 = off)")


def check_tp(m, tp: int, check) -> None:
    """Each tp rank holds n_head / tp heads (the common rule) and ffn / tp of the dense SwiGLU."""
    check(ffn_width(m) % tp == 0, "parallel.tp",
          f"tp={tp} must divide the dense layers' SwiGLU width {ffn_width(m)} (model.ffn_hidden)")


def tp_problem(m, tp: int) -> str | None:
    """Why tensor parallelism over `tp` ranks cannot split the model (the planner's words), or None."""
    if m.n_head % tp:
        return f"must divide n_head {m.n_head}"
    if ffn_width(m) % tp:
        return f"must divide the dense layers' SwiGLU width {ffn_width(m)} (model.ffn_hidden)"
    if m.block_size % tp:
        return f"must divide block_size {m.block_size} (sequence parallelism)"
    return None
