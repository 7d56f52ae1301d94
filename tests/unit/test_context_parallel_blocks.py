"""Context parallelism on one process (#51): the zig-zag split and its gather round trip
(hpctrain/parallel/zigzag.py), and the blockwise attention arithmetic of the ring
(hpctrain/parallel/attention_blocks.py): key blocks attended separately and merged by online
softmax equal full-sequence SDPA (causal, document ids, grouped-query heads), and the blocks'
recomputed backward from the merged log-sum-exp equals SDPA's gradients. The multi-rank ring and
Ulysses kernels: tests/mpi/test_context_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpctrain.parallel import attention_blocks as blocks
from hpctrain.parallel.zigzag import from_zigzag, split_batch, split_for_rank, to_zigzag

B, H, HKV, S, D = 2, 4, 2, 24, 8


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_rank_holds_chunks_r_and_2cp_minus_1_minus_r_and_round_trips(cp):
    seq = 8 * cp
    x = torch.arange(2 * seq).view(2, seq)
    parts = [split_for_rank(x, cp, r) for r in range(cp)]
    c = seq // (2 * cp)
    for r, part in enumerate(parts):
        expected = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert part[0].tolist() == expected
        assert part[1].tolist() == [seq + i for i in expected]
    assert torch.equal(from_zigzag(torch.cat(parts, dim=1), cp), x)
    assert torch.equal(from_zigzag(to_zigzag(x, cp), cp), x)


def test_split_batch_keeps_tokens_targets_positions_and_documents_aligned():
    tokens = torch.arange(100, 116).view(1, 16)
    docs = torch.tensor([[0] * 5 + [1] * 11])
    local = split_batch(tokens, tokens + 1, cp=2, rank=1, doc_ids=docs)
    assert local.positions.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]      # chunks 1 and 2 of 4
    assert torch.equal(local.tokens, 100 + local.positions)
    assert torch.equal(local.targets, local.tokens + 1)
    assert local.doc_ids.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="2 x cp = 6"):
        split_for_rank(tokens, 3, 0)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (H, HKV, HKV))
    starts = torch.rand(B, S, generator=g) < 0.15
    starts[:, 0] = False
    return q, k, v, starts.long().cumsum(1)  # document ids, a new one at random places


def _full_mask(docs: torch.Tensor | None) -> torch.Tensor:
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return causal if docs is None else causal & (docs[:, :, None] == docs[:, None, :])[:, None]


@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_merged_by_online_softmax_equal_full_attention(with_docs):
    q, k, v, docs = _inputs(1)
    docs = docs if with_docs else None
    full = _full_mask(docs)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    cuts = [0, 5, 13, 14, S]  # uneven key blocks, one of a single key
    out = torch.zeros(B, H, S, D)
    lse = torch.full((B, H, S), float("-inf"))
    for lo, hi in zip(cuts, cuts[1:]):
        mask = full[..., lo:hi].unsqueeze(-3)  # [.., 1, S, block]: broadcast over the q-head group
        o, l = blocks.block_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], mask, D ** -0.5)
        out, lse = blocks.merge(out, lse, o, l)
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() <= 1e-5
    scores = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * D ** -0.5
    ref_lse = torch.logsumexp(scores.masked_fill(~full, float("-inf")), -1)
    assert (lse - ref_lse).abs().max().item() <= 1e-5


@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_recomputed_backward_equals_sdpa_gradients(with_docs):
    q, k, v, docs = _inputs(2)
    docs = docs if with_docs else None
    full = _full_mask(docs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=full, enable_gqa=True)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    ref.backward(dout)
    out, lse = blocks.block_forward(q, k, v, full.unsqueeze(-3), D ** -0.5)
    delta = (dout * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in [(0, 7), (7, 8), (8, S)]:
        mask = full[..., lo:hi].unsqueeze(-3)
        gq, gk, gv = blocks.block_backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], lse, delta, mask,
                                           D ** -0.5)
        dq += gq
        dk[:, :, lo:hi] += gk
        dv[:, :, lo:hi] += gv
    for got, leaf in zip((dq, dk, dv), leaves):
        assert (got - leaf.grad).abs().max().item() <= 1e-5


def test_pair_mask_is_causal_on_the_diagonal_and_by_document():
    docs_q, docs_k = torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1]])
    assert blocks.pair_mask(2, 1, 3, None, None, torch.device("cpu")) is None  # an earlier chunk: all
    diag = blocks.pair_mask(1, 1, 3, docs_q, docs_q, torch.device("cpu"))
    assert diag[0, 0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    below = blocks.pair_mask(2, 1, 3, docs_q, docs_k, torch.device("cpu"))
    assert below[0, 0, 0].int().tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 1]]
