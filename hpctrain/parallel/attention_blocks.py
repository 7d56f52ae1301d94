"""The arithmetic of blockwise attention, in fp32: one (query chunk, key/value chunk) pair's
softmax attention with its log-sum-exp, the online-softmax merge of such blocks, and one pair's
backward from the whole row's log-sum-exp (the flash-attention recomputation), with grouped-query
heads (k/v heads dividing q heads, head h reading k/v head h // (H / H_kv), as SDPA's enable_gqa).

Owns: these formulas and the mask of a chunk pair (causal within a chunk, equal document ids).
It must never communicate (the ring: hpctrain/parallel/context_parallel.py).

Shapes: q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]; out [B, H, Sq, Dv]; lse [B, H, Sq].
A mask is None (every key visible) or a bool tensor broadcastable to [B, Hkv, H / Hkv, Sq, Sk]
(True: attend). A row with no visible key has out 0 and lse -inf.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, Hkv, H / Hkv, S, D] (q head h -> group h // (H / Hkv))."""
    return q.unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no visible key) replaced by 0, so exp(s - lse) is 0 there, never nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def pair_mask(q_chunk: int, k_chunk: int, chunk_len: int, doc_q: torch.Tensor | None,
              doc_k: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The causal (+ document) mask of global query chunk `q_chunk` against key chunk `k_chunk`
    (both of `chunk_len` tokens; q_chunk >= k_chunk): lower-triangular on the diagonal, all visible
    below it; with document ids ([B, chunk_len] each) a query sees only keys of its own document."""
    mask = None
    if q_chunk == k_chunk:
        mask = torch.ones(chunk_len, chunk_len, dtype=torch.bool, device=device).tril()
    if doc_q is not None:
        same_doc = (doc_q[:, :, None] == doc_k[:, None, :])[:, None, None]  # [B, 1, 1, Sq, Sk]
        mask = same_doc if mask is None else same_doc & mask
    return mask


def _scores(q5: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax(q k^T * scale) v (out) and log-sum-exp of its scores (lse), in fp32."""
    q5 = _grouped(q.float(), k.shape[1])
    s = _scores(q5, k.float(), mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - _finite(lse).unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


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
                   lse: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv (fp32), the probabilities recomputed from the whole row's
    `lse` (all blocks merged) and `delta` = rowsum(dout * out) of the row's final output."""
    kv_heads = k.shape[1]
    q5, k32, v32 = _grouped(q.float(), kv_heads), k.float(), v.float()
    dout5 = _grouped(dout.float(), kv_heads)
    p = torch.exp(_scores(q5, k32, mask, scale) - _finite(_grouped(lse, kv_heads)).unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ dout5).sum(2)
    dp = dout5 @ v32.unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - _grouped(delta, kv_heads).unsqueeze(-1))
    dq = (ds @ k32.unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq.flatten(1, 2), dk, dv
