"""Context parallelism on one process (#51): the zig-zag split and its gather round trip
(hpctrain/parallel/zigzag.py), and the blockwise attention arithmetic of the ring
(hpctrain/parallel/attention_blocks.py), on both its CPU fused kernel and its fp32 matmul one: key
blocks attended separately and merged by online softmax equal full-sequence SDPA (causal, document
ids, grouped-query heads, a v width other than q/k's, blocks larger than the fused kernel's tiles
with rows that see nothing in a block), and the blocks' recomputed backward from the merged
log-sum-exp equals SDPA's gradients; the fused kernel never materialises a [query, key] score
matrix; Ulysses' whole-sequence attention with documents runs it causal. The multi-rank ring and
Ulysses kernels: tests/mpi/test_context_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.parallel import attention_blocks as blocks
from hpctrain.parallel.context_parallel import _documents_attention
from hpctrain.parallel.zigzag import from_zigzag, split_batch, split_for_rank, to_zigzag

B, H, HKV, S, D = 2, 4, 2, 24, 8
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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


KERNELS = {"fused": (blocks._fused_forward, blocks._fused_backward),
           "matmul": (blocks._matmul_forward, blocks._matmul_backward)}


def _inputs(seed: int, seq: int = S, heads: int = H, v_dim: int = D):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, h, seq, D, generator=g) for h in (heads, HKV))
    v = torch.randn(B, HKV, seq, v_dim, generator=g)
    starts = torch.rand(B, seq, generator=g) < 0.15
    starts[:, 0] = False
    return q, k, v, starts.long().cumsum(1)  # document ids, a new one at random places


def _visible(docs: torch.Tensor | None, seq: int = S) -> torch.Tensor:
    """[B, 1, S, S] bool: causal and, with documents, same document."""
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(B, 1, seq, seq)
    return causal if docs is None else causal & (docs[:, :, None] == docs[:, None, :])[:, None]


def _sdpa(q, k, v, visible, dout):
    """Reference output and q, k, v gradients (SDPA's math kernel: any v width)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=visible, enable_gqa=True)
    ref.backward(dout)
    return ref.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_merged_by_online_softmax_equal_full_attention(kernel, with_docs):
    forward, _ = KERNELS[kernel]
    q, k, v, docs = _inputs(1)
    visible = _visible(docs if with_docs else None)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    cuts = [0, 5, 13, 14, S]  # uneven key blocks, one of a single key; early rows see none of most
    out = torch.zeros(B, H, S, D)
    lse = torch.full((B, H, S), float("-inf"))
    for lo, hi in zip(cuts, cuts[1:]):
        mask = blocks.BlockMask(allowed=visible[:, 0, :, lo:hi])
        o, l = forward(q, k[:, :, lo:hi], v[:, :, lo:hi], mask, D ** -0.5)
        out, lse = blocks.merge(out, lse, o, l)
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() <= 1e-5
    scores = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * D ** -0.5
    ref_lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)
    assert (lse - ref_lse).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_recomputed_backward_equals_sdpa_gradients(kernel, with_docs):
    forward, backward = KERNELS[kernel]
    q, k, v, docs = _inputs(2)
    visible = _visible(docs if with_docs else None)
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(3))
    ref = _sdpa(q, k, v, visible, dout)
    out, lse = forward(q, k, v, blocks.BlockMask(allowed=visible[:, 0]), D ** -0.5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in [(0, 7), (7, 8), (8, S)]:
        mask = blocks.BlockMask(allowed=visible[:, 0, :, lo:hi])
        gq, gk, gv = backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, mask, D ** -0.5)
        dq += gq
        dk[:, :, lo:hi] += gk
        dv[:, :, lo:hi] += gv
    for got, want in zip((dq, dk, dv), ref[1:]):
        assert (got - want).abs().max().item() <= 1e-5


def _chunk_pairs(q, k, v, docs, chunks: int, kernel: str, dout):
    """The ring's arithmetic on one process: every causal (query chunk, key chunk) pair with its
    `pair_mask` (views of q, k, v, as the ring's halves), merged, then each pair's backward."""
    forward, backward = KERNELS[kernel]
    cut = lambda t: t.chunk(chunks, dim=2)  # noqa: E731
    doc = (lambda a: None) if docs is None else (lambda a: docs.chunk(chunks, dim=1)[a])  # noqa: E731
    q_c, k_c, v_c, dout_c = cut(q), cut(k), cut(v), cut(dout)
    pairs = [(a, b) for a in range(chunks) for b in range(a + 1)]
    outs, lses = [], []
    for a in range(chunks):
        out = torch.zeros(*q_c[a].shape[:3], v.shape[-1])
        lse = torch.full(q_c[a].shape[:3], float("-inf"))
        for b in range(a + 1):
            mask = blocks.pair_mask(a, b, doc(a), doc(b))
            o, l = forward(q_c[a], k_c[b], v_c[b], mask, q.shape[-1] ** -0.5)
            out, lse = blocks.merge(out, lse, o, l)
        outs.append(out)
        lses.append(lse)
    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    dq_c, dk_c, dv_c = (cut(g) for g in grads)
    for a, b in pairs:
        gq, gk, gv = backward(dout_c[a], q_c[a], k_c[b], v_c[b], outs[a], lses[a],
                              blocks.pair_mask(a, b, doc(a), doc(b)), q.shape[-1] ** -0.5)
        dq_c[a].add_(gq)
        dk_c[b].add_(gk)
        dv_c[b].add_(gv)
    return torch.cat(outs, dim=2), *grads


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("v_dim", [D, 12, 5])  # v as wide as q/k, wider, narrower (MLA)
def test_chunk_pairs_with_their_masks_equal_sdpa(kernel, with_docs, v_dim):
    q, k, v, docs = _inputs(4, v_dim=v_dim)
    docs = docs if with_docs else None
    dout = torch.randn(B, H, S, v_dim, generator=torch.Generator().manual_seed(5))
    got = _chunk_pairs(q, k, v, docs, 4, kernel, dout)
    for g, want in zip(got, _sdpa(q, k, v, _visible(docs), dout)):
        assert g.shape == want.shape and (g - want).abs().max().item() <= 1e-5


def test_fused_chunks_larger_than_its_tiles_equal_sdpa_with_rows_masked_in_a_tile():
    """Chunks of 600 keys: the CPU kernel splits them into tiles (of at most 512), so with short
    documents a query sees no key in one tile and some in another, or none in a whole chunk."""
    seq = 1200
    q, k, v, _ = _inputs(6, seq=seq, heads=HKV)
    docs = torch.tensor([[0] * 100 + [1] * 580 + [2] * 20 + [3] * 500,
                         [0] * 550 + [1] * 640 + [2] * 10])
    dout = torch.randn(B, HKV, seq, D, generator=torch.Generator().manual_seed(7))
    got = _chunk_pairs(q, k, v, docs, 2, "fused", dout)
    for g, want in zip(got, _sdpa(q, k, v, _visible(docs, seq), dout)):
        assert (g - want).abs().max().item() <= 1e-5


def test_fused_bf16_blocks_are_as_close_to_sdpa_as_bf16_sdpa_is():
    q, k, v, docs = _inputs(8)
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(9))
    want = _sdpa(q, k, v, _visible(docs), dout)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    got = _chunk_pairs(*bf16, docs, 4, "fused", dout.bfloat16())
    plain = _sdpa(*bf16, _visible(docs), dout.bfloat16())
    for g, p, w in zip(got, plain, want):
        assert (g.float() - w).abs().max().item() <= 2 * (p.float() - w).abs().max().item() + 1e-3


def _largest_output(fn) -> int:
    """The largest number of elements of any tensor an aten op returned while `fn` ran."""
    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return result

    with Largest():
        fn()
    return Largest.numel


@pytest.mark.parametrize("with_docs", [False, True])
def test_fused_blocks_materialise_no_query_by_key_matrix_per_head(with_docs):
    c, heads = 256, 8
    g = torch.Generator().manual_seed(10)
    q, k, v, dout = (torch.randn(1, heads, c, 16, generator=g) for _ in range(4))
    docs = torch.tensor([[0] * 100 + [1] * 156]) if with_docs else None
    mask = blocks.pair_mask(1, 1, docs, docs)
    out, lse = blocks.block_forward(q, k, v, mask, 0.25)
    largest = _largest_output(lambda: blocks.block_forward(q, k, v, mask, 0.25))
    largest = max(largest, _largest_output(
        lambda: blocks.block_backward(dout, q, k, v, out, lse, mask, 0.25)))
    assert largest <= c * c  # a document mask [1, c, c] at most; per-head scores: heads * c * c


def test_pair_mask_is_causal_on_the_diagonal_and_by_document():
    docs_q, docs_k = torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1]])
    below = blocks.pair_mask(2, 1, None, None)
    assert not below.causal and below.visible(3, 3, torch.device("cpu")) is None  # every key
    diag = blocks.pair_mask(1, 1, docs_q, docs_q).visible(3, 3, torch.device("cpu"))
    assert diag[0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    below = blocks.pair_mask(2, 1, docs_q, docs_k).visible(3, 3, torch.device("cpu"))
    assert below[0, 0].int().tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 1]]


class _FlashCalls(TorchDispatchMode):
    """Records is_causal of every call of torch's fused CPU flash kernel (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.causal: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (FLASH.default, FLASH_BACKWARD.default):
            at = [a.name for a in func._schema.arguments].index("is_causal")
            self.causal.append(bool(args[at] if at < len(args) else kwargs.get("is_causal", False)))
        return func(*args, **kwargs)


def test_ulysses_documents_attention_equals_sdpa_and_runs_the_causal_fused_kernel():
    """Ulysses' whole-sequence attention with documents (context_parallel._documents_attention):
    on the CPU the fused kernel causal, with the documents as its mask (SDPA with an explicit mask
    runs it non-causal, attending the upper half too), equal to SDPA forward and backward."""
    q, k, v, docs = _inputs(11)
    visible = _visible(docs)
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(12))
    want = _sdpa(q, k, v, visible, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    calls = _FlashCalls()
    with calls:
        out = _documents_attention(*leaves, docs, None)
        out.backward(dout)
    assert calls.causal == [True, True]  # one forward, one backward
    for got, w in zip([out.detach()] + [t.grad for t in leaves], want):
        assert (got - w).abs().max().item() <= 1e-5
