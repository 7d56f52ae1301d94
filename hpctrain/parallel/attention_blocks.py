"""Blockwise attention: one (query chunk, key/value chunk) pair's softmax attention with its
log-sum-exp, the online-softmax merge of such blocks, and one pair's backward from the whole row's
output and log-sum-exp (the flash-attention recomputation), with grouped-query heads (k/v heads
dividing q heads, head h reading k/v head h // (H / H_kv), as SDPA's enable_gqa).

On the CPU a block runs torch's fused flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`
and its `_backward`: tiled, no [Sq, Sk] score matrix, causal blocks skip their upper half, GQA
native); a v narrower or wider than q/k (multi-head latent attention) is zero-padded to the common
width, which leaves the scores and the output unchanged; document masks go in as an additive 0 / -inf
bias, and rows with no visible key (for which the kernel returns lse 0) get lse -inf here. On other
devices the same formulas run as fp32 matmuls (`_matmul_forward`, `_matmul_backward`). Either way
a block's output and log-sum-exp come back in fp32 and the merge is fp32.

Owns: these formulas and the mask of a chunk pair (causal within a chunk, equal document ids).
It must never communicate (the ring: hpctrain/parallel/context_parallel.py).

Shapes: q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]; out [B, H, Sq, Dv]; lse [B, H, Sq].
A `BlockMask` says which keys a query sees. A row with no visible key has out 0 and lse -inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class BlockMask:
    """Which keys of one block each query sees: lower-triangular if `causal` (a chunk's own pair,
    Sq == Sk), only those where `allowed` ([B, Sq, Sk] bool, e.g. the same document) is True;
    neither: every key."""

    causal: bool = False
    allowed: torch.Tensor | None = None

    def visible(self, sq: int, sk: int, device: torch.device) -> torch.Tensor | None:
        """[B or 1, 1, Sq, Sk] bool (True: attend), or None when every key is visible."""
        mask = None if self.allowed is None else self.allowed[:, None]
        if self.causal:
            tril = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device).tril()
            mask = tril if mask is None else mask & tril
        return mask


def pair_mask(q_chunk: int, k_chunk: int, doc_q: torch.Tensor | None,
              doc_k: torch.Tensor | None) -> BlockMask:
    """The mask of global query chunk `q_chunk` against key chunk `k_chunk` (q_chunk >= k_chunk):
    causal on the diagonal, all visible below it; with document ids ([B, chunk_len] each) a query
    sees only keys of its own document."""
    allowed = None if doc_q is None else doc_q[:, :, None] == doc_k[:, None, :]
    return BlockMask(causal=q_chunk == k_chunk, allowed=allowed)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no visible key) replaced by 0, so exp(s - lse) is 0 there, never nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _doc_bias(mask: BlockMask, dtype: torch.dtype) -> torch.Tensor | None:
    """The documents as the fused kernel's additive mask: [B, 1, Sq, Sk], 0 visible, -inf not."""
    if mask.allowed is None:
        return None
    bias = torch.zeros(mask.allowed.shape, dtype=dtype, device=mask.allowed.device)
    return bias.masked_fill_(~mask.allowed, NEG_INF)[:, None]


def _fused_forward(q, k, v, mask: BlockMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    width, v_dim = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    out, lse = _FLASH_CPU(_pad_to(q, width), _pad_to(k, width), _pad_to(v, width), 0.0, mask.causal,
                          attn_mask=_doc_bias(mask, q.dtype), scale=scale)
    if mask.allowed is not None:  # rows with no visible key: the kernel says lse 0 (out is 0)
        seen = mask.visible(q.shape[2], k.shape[2], q.device).any(-1)  # [B, 1, Sq]
        lse = lse.masked_fill(~seen, NEG_INF)
    return out[..., :v_dim].float(), lse.float()


def _fused_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    width, q_dim, v_dim = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    pad = lambda t: _pad_to(t.to(q.dtype), width)  # noqa: E731
    dq, dk, dv = _FLASH_CPU_BACKWARD(pad(dout), pad(q), pad(k), pad(v), pad(out), lse.float(), 0.0,
                                     mask.causal, attn_mask=_doc_bias(mask, q.dtype), scale=scale)
    return dq[..., :q_dim].float(), dk[..., :q_dim].float(), dv[..., :v_dim].float()


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, Hkv, H / Hkv, S, D] (q head h -> group h // (H / Hkv))."""
    return q.unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def _scores(q5: torch.Tensor, k: torch.Tensor, mask: BlockMask, scale: float) -> torch.Tensor:
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    visible = mask.visible(q5.shape[3], k.shape[2], q5.device)
    return s if visible is None else s.masked_fill(~visible.unsqueeze(2), NEG_INF)


def _matmul_forward(q, k, v, mask: BlockMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q5 = _grouped(q.float(), k.shape[1])
    s = _scores(q5, k.float(), mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - _finite(lse).unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _matmul_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    kv_heads = k.shape[1]
    q5, k32, v32 = _grouped(q.float(), kv_heads), k.float(), v.float()
    dout5 = _grouped(dout.float(), kv_heads)
    delta = _grouped((dout.float() * out.float()).sum(-1), kv_heads)
    p = torch.exp(_scores(q5, k32, mask, scale) - _finite(_grouped(lse, kv_heads)).unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ dout5).sum(2)
    dp = dout5 @ v32.unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = (ds @ k32.unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq.flatten(1, 2), dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax(q k^T * scale) v (out) and log-sum-exp of its scores (lse), both fp32."""
    return (_fused_forward if _fused(q) else _matmul_forward)(q, k, v, mask, scale)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: the attention over keys A ∪ B from its parts over A (out, lse) and B
    (block_out, block_lse), each normalised over its own keys; fp32."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    merged = (out * torch.exp(lse - safe).unsqueeze(-1)
              + block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    return merged, new_lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, mask: BlockMask,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv (fp32), the probabilities recomputed from the whole row's
    `lse` (all blocks merged) and its final output `out` (for rowsum(dout * out))."""
    return (_fused_backward if _fused(q) else _matmul_backward)(dout, q, k, v, out, lse, mask, scale)
