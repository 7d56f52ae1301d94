"""Mixture-of-experts feed-forward for the Llama-family model (architecture only): a token-choice
top-k router, SwiGLU experts stored as 3-D weights, optional shared experts, dropless.

Owns: the router (softmax gates as Mixtral / Qwen2-MoE, or sigmoid gates with DeepSeek-V3's
auxiliary-loss-free balancing bias), the experts' parameters and their names, the dropless
computation (tokens sorted by expert, each expert's matmul over its contiguous rows: one grouped
matmul per weight where torch has it for the tensors at hand (`torch._grouped_mm`: CPU fp32/bf16;
CUDA bf16 on Hopper or newer, every group padded with zero rows to 16), else a Python loop over
experts, never over tokens; no capacity, no token dropped whatever
the imbalance), the
Switch/Mixtral auxiliary load-balancing loss (added to the gradient inside the layer, so no loss
code, pipeline stage or activation checkpoint has to carry it), and the per-layer load statistics
a metrics hook reads. Like the families' model.py it must never import distributed, checkpoint, data or loss
code: expert parallelism is applied from outside, and the balancing bias is updated from outside
(`update_balance_bias`, after an optimizer step, with the load summed over the data-parallel ranks).

Shapes: experts.w1 / w3 [E, H, C] (gate / up), experts.w2 [E, C, H] (down), router.weight [E, C],
router.bias [E] (a parameter with requires_grad False: checkpointed, replicated, never trained),
shared.w1 / w3 [1, S, C], shared.w2 [1, C, S], shared_gate.weight [1, C].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.moe_rows import combine, dispatch, rows_by_token

GATES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 0          # 0: the dense model's SwiGLU width
    n_shared_experts: int = 0       # always-on experts (Qwen2-MoE, DeepSeek), run as one SwiGLU
    shared_hidden: int = 0          # its width (0: n_shared_experts x the routed experts' width)
    shared_gate: bool = False       # Qwen2-MoE: the shared output scaled by sigmoid(x . w_gate)
    gate: str = "softmax"           # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True     # renormalize the k selected gates to sum to 1
    aux_loss_coef: float = 0.0      # Switch/Mixtral load-balancing loss weight (0: off)
    bias_update_rate: float = 0.0   # DeepSeek-V3 auxiliary-loss-free balancing step (0: off)


class AuxLossInGradient(torch.autograd.Function):
    """Identity on `out`; in backward it adds d(scale x aux)/d(aux) = scale to `aux`'s gradient, so
    the auxiliary loss trains the router wherever the layer sits (pipeline stage, recomputation).
    `scale` is the loss weight times the micro-batch weight the runner gives the main loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device), None


class Experts(nn.Module):
    """E SwiGLU experts as three 3-D weights; `forward` runs rows already sorted by expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor,
                counts_host: list[int] | None = None) -> torch.Tensor:
        """x_sorted [N, C], rows grouped by expert, counts[e] rows for local expert e (a host list,
        or a tensor on x's device: MoEFeedForward's, which expert parallelism exchanges as is).
        `counts_host`: the same counts on the host, when the caller has them (no host copy here)."""
        if _grouped_mm_fits(x_sorted, self.w1, self.w3, self.w2):
            counts = torch.as_tensor(counts, device=x_sorted.device)
            return grouped_swiglu(x_sorted, self.w1, self.w3, self.w2, counts.cumsum(0).to(torch.int32))
        counts_t = counts if isinstance(counts, torch.Tensor) else None
        if counts_host is None:  # the CUDA and loop paths size their groups on the host: on a GPU
            counts_host = host_list(counts_t) if counts_t is not None else list(counts)  # one sync
        if _cuda_grouped_mm_fits(x_sorted, self.w1):
            return cuda_grouped_swiglu(x_sorted, self.w1, self.w3, self.w2, counts_host, counts_t)
        return loop_swiglu(x_sorted, self.w1, self.w3, self.w2, counts_host)


def host_list(t: torch.Tensor) -> list:
    """t's values on the host, copied by one dispatched op (aten._to_copy: on a GPU the layer's
    one device->host sync), which activation checkpointing keeps from the forward instead of
    copying again in the recomputation (hpctrain/parallel/activation.py)."""
    return t.to("cpu", copy=True).tolist()


def loop_swiglu(x_sorted: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
    """Every expert's SwiGLU over its contiguous rows, one matmul per expert and weight."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = x_sorted[start:start + n]
        outs.append(F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e]))
        start += n
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, w2.shape[1])


GROUP_ALIGN = 16  # rows per group that CUDA's grouped-matmul kernel is given (torchtitan pads to 8-32)


def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   ends: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU over its rows of x (group e = rows ends[e-1]:ends[e]) in three grouped
    matmuls."""
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=ends)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=ends)


def cuda_grouped_swiglu(x_sorted: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                        counts: list[int], counts_t: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA's grouped matmul: bf16 (autocast's dtype when autocast is on, as F.linear would cast),
    every group padded with zero rows to GROUP_ALIGN (the rows are gathered back). `counts_t`:
    the same counts on the device, when the caller has them (saves a blocking host->device copy)."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x_sorted.dtype
    with torch.autocast("cuda", enabled=False):
        padded, ends, rows = pad_groups(x_sorted.to(dtype), counts, GROUP_ALIGN, counts_t)
        out = grouped_swiglu(padded, w1.to(dtype), w3.to(dtype), w2.to(dtype), ends)
        return out.index_select(0, rows)


def pad_groups(x: torch.Tensor, counts: list[int], align: int,
               counts_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows (grouped by expert, counts[e] each) placed in a zero buffer where every group
    starts at a multiple of `align`: (buffer, the groups' int32 end offsets in it, each row of x's
    index in it). No host sync: the buffer's size comes from `counts`, already on the host, the
    offsets from `counts_t` (the same counts on x's device; made from `counts` when not given, a
    blocking copy). (A sync-free form that sizes the buffer for the worst case, N + E x align,
    measured 0.90x this one's MoE training tokens/s on an H200: docs/benchmarks.md.)"""
    n_rows, device = sum(counts), x.device
    n_padded = sum(-(-n // align) * align for n in counts)
    counts_t = torch.tensor(counts, device=device) if counts_t is None else counts_t.to(device, torch.int64)
    sizes_t = (counts_t + (align - 1)) // align * align
    shift = (sizes_t.cumsum(0) - sizes_t) - (counts_t.cumsum(0) - counts_t)  # group start, padded - dense
    rows = torch.repeat_interleave(shift, counts_t, output_size=n_rows) + torch.arange(n_rows, device=device)
    padded = x.new_zeros(n_padded, x.shape[1]).index_copy(0, rows, x)
    return padded, sizes_t.cumsum(0).to(torch.int32), rows


def _grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these tensors: on the CPU, fp32 or bf16, one dtype (under
    autocast the loop's F.linear does the casting)."""
    return (hasattr(torch, "_grouped_mm") and x.device.type == "cpu" and x.shape[0] > 0
            and x.dtype in (torch.float32, torch.bfloat16)
            and all(w.dtype == x.dtype and w.device == x.device for w in weights))


def _cuda_grouped_mm_fits(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """CUDA's kernel: Hopper (sm90) or newer, bf16 (the input's dtype or autocast's), widths whose
    rows are 16-byte aligned; elsewhere (older GPUs, fp32/fp16 without autocast) the loop runs."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.shape[0] > 0):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return (dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
            and x.shape[1] % 8 == 0 and w1.shape[1] % 8 == 0)


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, dim))
        self.bias = nn.Parameter(torch.zeros(cfg.n_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, C] -> (gates [T, k] in x's dtype's fp32, expert ids [T, k], scores [T, E] fp32)."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.cfg.gate == "softmax" else logits.sigmoid()
        # the balancing bias moves the choice only, never a gate's value (DeepSeek-V3 eq. 16)
        choice = scores + self.bias.float() if self.cfg.bias_update_rate > 0 else scores
        ids = choice.topk(self.cfg.top_k, dim=-1).indices
        gates = scores.gather(-1, ids)
        if self.cfg.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        return gates, ids, scores


class MoEFeedForward(nn.Module):
    """The block's `mlp` where the layer is sparse: routed experts (+ shared ones)."""

    aux_scale: float = 1.0  # the runner's micro-batch weight (1 / grad_accum); set from outside

    def __init__(self, dim: int, hidden: int, cfg: MoEConfig):
        super().__init__()
        if cfg.gate not in GATES or not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"moe: gate must be one of {GATES} and 1 <= top_k <= n_experts")
        self.cfg, hidden = cfg, cfg.expert_hidden or hidden
        self.router = Router(dim, cfg)
        self.experts = Experts(cfg.n_experts, dim, hidden)
        shared = cfg.shared_hidden or hidden * cfg.n_shared_experts
        self.shared = Experts(1, dim, shared) if cfg.n_shared_experts else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if cfg.n_shared_experts and cfg.shared_gate else None
        self.load: torch.Tensor | None = None  # tokens routed since the last read (made at first use:
        # a model built on the meta device has no data for it)
        self.last_aux_loss: torch.Tensor | None = None  # detached, read by the metrics hook
        self.last_entropy: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, ids, scores = self.router(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # routed rows grouped by expert, token order inside
        # rows per expert, without bincount (on CUDA it reads the ids' min and max on the host)
        counts = torch.zeros(self.cfg.n_experts, dtype=torch.int64, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))
        # each sorted row's token, and the rows grouped by token: dispatch and combine (and their
        # backward) gather and add in a fixed order, no atomics (hpctrain/model/moe_rows.py)
        token_of_row, top_k = order // self.cfg.top_k, self.cfg.top_k
        by_token = rows_by_token(token_of_row)
        out_sorted = self.experts(dispatch(x, token_of_row, by_token, top_k), counts)  # on x's device
        weighted = out_sorted * gates.reshape(-1)[order, None]  # fp32 gates, as transformers
        out = combine(weighted.to(x.dtype), token_of_row, by_token, top_k)
        if self.shared is not None:
            shared = self.shared(x, [x.shape[0]])
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        self._observe(counts, scores)
        if self.training and self.cfg.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(scores, counts, self.cfg.top_k)
            self.last_aux_loss = aux.detach()
            out = AuxLossInGradient.apply(out, aux, self.cfg.aux_loss_coef * self.aux_scale)
        return out.reshape(shape)

    def _observe(self, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """Load and router entropy of a training forward (a recomputation in backward is not counted
        twice; a validation forward, in eval mode, not at all)."""
        if torch._C._current_graph_task_id() != -1 or not self.training:  # recomputation / eval
            return
        with torch.no_grad():
            self.load = counts.clone() if self.load is None else self.load.to(counts.device) + counts
            p = scores / scores.sum(-1, keepdim=True)
            self.last_entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()

    def take_load(self) -> torch.Tensor:
        """Tokens routed to each expert since the last call (then reset)."""
        load, self.load = self.load, None
        return torch.zeros(self.cfg.n_experts, dtype=torch.int64) if load is None else load

    @torch.no_grad()
    def update_balance_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: raise the bias of under-loaded experts, lower
        it for over-loaded ones, by bias_update_rate (`load`: tokens per expert, summed over the
        ranks that share this router, so every rank makes the same step)."""
        rate = self.cfg.bias_update_rate
        if rate > 0:
            load = load.to(self.router.bias.device, torch.float32)
            self.router.bias.add_(rate * torch.sign(load.mean() - load))


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer / Mixtral: E x sum_e f_e P_e, f_e the fraction of routed slots that went
    to expert e, P_e its mean router probability (1.0 when perfectly balanced)."""
    n_experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)
    f = counts.to(probs.dtype) / (scores.shape[0] * top_k)
    return n_experts * (f * probs.mean(0)).sum()


def init_moe_(moe: MoEFeedForward, std: float, out_std: float) -> None:
    """N(0, std) for the router and w1/w3, N(0, out_std) for w2 (the residual projection), as
    the dense block's reset_parameters does; the balancing bias 0."""
    nn.init.normal_(moe.router.weight, 0.0, std)
    moe.router.bias.zero_()
    if moe.shared_gate is not None:
        nn.init.normal_(moe.shared_gate.weight, 0.0, std)
    for experts in filter(None, (moe.experts, moe.shared)):
        nn.init.normal_(experts.w1, 0.0, std)
        nn.init.normal_(experts.w3, 0.0, std)
        nn.init.normal_(experts.w2, 0.0, out_std)
