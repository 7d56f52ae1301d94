"""Causal self-attention for every model family: the one place that calls
F.scaled_dot_product_attention, with or without document masking.

Without document ids it is exactly the SDPA call every family made before (is_causal=True: the same
kernel, the same bits). With per-token document ids ([B, T], from data.document_mask) a query attends
only to earlier keys of its own document: a block-diagonal causal boolean mask [B, 1, T, T], passed
to SDPA as attn_mask. FlexAttention (create_block_mask + flex_attention) would skip the masked-out
blocks, but on this torch it has no backward on the CPU ("FlexAttention does not support backward on
CPU"), so every device takes SDPA with the mask (measured on 2 x 4 heads x 512 x 32, fp32, fwd+bwd
on the CPU: 215 ms with the mask vs 204 ms is_causal). Grouped-query k / v (fewer heads than q) and
multi-head latent attention's v width (v_head_dim != the qk width) go through unchanged.

Owns: `causal_attention`, its mask, and `rope_angles` (a rotary table for positions 0..T-1, or for
each token's position in its document [B, T]). It must never import distributed code, build a
model or read data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query i may attend key j iff j <= i and both are in one document."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     doc_ids: torch.Tensor | None = None, *, scale: float | None = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """q [B, H, T, d], k [B, H_kv, T, d], v [B, H_kv, T, d_v] -> [B, H, T, d_v]; H_kv dividing H
    is grouped-query attention. ``doc_ids`` [B, T] (per-token document numbers, None: one
    sequence): attention stays inside each document."""
    gqa = k.shape[1] != q.shape[1]
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids), scale=scale,
                                          dropout_p=dropout_p, enable_gqa=gqa)


def rope_angles(inv_freq: torch.Tensor, t: int, positions: torch.Tensor | None) -> torch.Tensor:
    """Rotary angles in fp32: [t, 2 x len(inv_freq)] for positions 0..t-1, or with ``positions``
    [B, T] (each token's position in its document) [B, 1, T, 2 x len(inv_freq)], which broadcasts
    over the heads of q / k [B, H, T, d]."""
    if positions is None:
        freqs = torch.outer(torch.arange(t, device=inv_freq.device, dtype=torch.float32), inv_freq)
    else:
        freqs = (positions.to(torch.float32)[..., None] * inv_freq).unsqueeze(1)
    return torch.cat((freqs, freqs), dim=-1)
