"""Context parallelism's attention: a causal attention whose sequence is split over the cp ranks of
`group` in the zig-zag layout (hpctrain/parallel/zigzag.py: rank r holds global chunks r and
2cp-1-r), exact (equal to full-sequence attention within fp32 rounding), forward and backward.

- `ring_attention`: each rank keeps its queries; the key/value blocks travel around the ring (cp - 1
  exchanges, the next block's transfer overlapping this block's compute), each (query chunk, key
  chunk) pair is attended by hpctrain/parallel/attention_blocks.py (on the CPU torch's fused flash
  kernel: no [c, c] score matrix, causal pairs skip their upper half) and merged by online softmax
  (log-sum-exp, fp32); fully masked pairs (a later key chunk; with document ids, no document in
  both chunks) are skipped. The backward is recompute-based (flash attention's): from the saved
  q, k, v, output and log-sum-exp each rank recomputes every live pair's probabilities while the
  key/value blocks travel around the ring again, their dK/dV accumulators travelling with them,
  one more exchange bringing each home.
- `ulysses_attention`: all-to-all from sequence-sharded to head-sharded (every rank the whole
  sequence for H / cp heads), SDPA locally, all-to-all back; needs cp to divide the q and k/v heads.

Both take a `CPPlan`, built once per batch (and reused by every layer): the cp group, this rank's
place, and with document masking the whole sequence's document ids and the ring's live pairs (one
all-gather and one host sync per batch, none per layer).

Point-to-point order: even ranks send before they receive, odd ranks receive before they send, so
the ring finishes even where a send waits for its receive and a rank's operations run in issue
order (NCCL, #49); tests/mpi/scripts/context_parallel_probe.py runs it with such Gloo sends.

Owns: the plan, the ring exchanges and the all-to-alls of attention. It must never split data or
touch model weights; the trainer, loader, checkpoint and planner do not use it yet
(docs/parallelism.md, "Context parallelism").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.parallel import attention_blocks as blocks
from hpctrain.parallel.zigzag import from_zigzag, gather_sequence, rank_chunks, to_zigzag

KV_TAG, GRAD_TAG = 0, 1


@dataclass(frozen=True)
class CPPlan:
    """What every attention of one batch needs to know about the cp split."""

    group: dist.ProcessGroup
    cp: int
    rank: int
    doc_ids: torch.Tensor | None = None          # [B, S] in natural order, or None (causal only)
    live: frozenset[tuple[int, int]] = frozenset()  # (q chunk, k chunk) pairs with a visible key

    @classmethod
    def build(cls, group: dist.ProcessGroup, local_len: int,
              local_doc_ids: torch.Tensor | None = None) -> "CPPlan":
        """Collective over `group` when `local_doc_ids` ([B, local_len], this rank's zig-zag part)
        are given: they are gathered once, and which chunk pairs any query sees decided once."""
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        if local_len % 2:
            raise ValueError(f"context parallelism: a rank's {local_len} tokens are not two equal "
                             f"chunks (the sequence length must be a multiple of 2 x cp = {2 * cp})")
        causal = {(a, b) for a in range(2 * cp) for b in range(a + 1)}
        if local_doc_ids is None:
            return cls(group, cp, rank, None, frozenset(causal))
        doc_ids = gather_sequence(local_doc_ids, group, dim=1)
        chunks = doc_ids.chunk(2 * cp, dim=1)
        pairs = sorted(causal)
        shared = torch.stack([_share_a_document(chunks[a], chunks[b]) for a, b in pairs])
        live = frozenset(p for p, yes in zip(pairs, shared.tolist()) if yes)
        return cls(group, cp, rank, doc_ids, live)

    def chunk_docs(self, chunk: int) -> torch.Tensor | None:
        if self.doc_ids is None:
            return None
        return self.doc_ids.chunk(2 * self.cp, dim=1)[chunk]

    def peer(self, offset: int) -> int:
        """The global rank `offset` places further round the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.cp)


def _share_a_document(q_docs: torch.Tensor, k_docs: torch.Tensor) -> torch.Tensor:
    """Whether any batch row has a document id in both chunks ([B, c] each; a 0-d bool tensor)."""
    return torch.stack([torch.isin(q, k).any() for q, k in zip(q_docs, k_docs)]).any()


def _ring_exchange(send: torch.Tensor, plan: CPPlan, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank and receiving the previous rank's into a new tensor."""
    recv = torch.empty_like(send)
    ops = [(dist.isend, send, plan.peer(1)), (dist.irecv, recv, plan.peer(-1))]
    if plan.rank % 2:  # odd ranks receive first
        ops.reverse()
    return recv, [op(t, peer, group=plan.group, tag=tag) for op, t, peer in ops]


def _wait(works: list) -> None:
    for w in works:
        if w is not None:
            w.wait()


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: torch.Tensor, shapes: tuple[torch.Size, ...]) -> list[torch.Tensor]:
    return [p.view(shape) for p, shape in zip(flat.split([shape.numel() for shape in shapes]), shapes)]


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A rank's two chunks (views) of a [B, heads, S / cp, ...] tensor."""
    return t.chunk(2, dim=2)


def _live_pairs(plan: CPPlan, src: int):
    """(my q half, src's k half, their global chunks) of every live pair of my queries and rank
    src's keys."""
    for qi, a in enumerate(rank_chunks(plan.cp, plan.rank)):
        for ki, b in enumerate(rank_chunks(plan.cp, src)):
            if (a, b) in plan.live:
                yield qi, ki, a, b


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CPPlan, scale: float):
        q_h, shapes = _halves(q), (k.shape, v.shape)
        outs, lses = [None, None], [None, None]  # a half's first block (its own chunk's, step 0)
        kv = _pack(k, v)
        for step in range(plan.cp):
            src = (plan.rank - step) % plan.cp
            if step < plan.cp - 1:
                nxt, works = _ring_exchange(kv, plan, KV_TAG)
            k_h, v_h = (_halves(t) for t in _unpack(kv, shapes))
            for qi, ki, a, b in _live_pairs(plan, src):
                mask = blocks.pair_mask(a, b, plan.chunk_docs(a), plan.chunk_docs(b))
                o, l = blocks.block_forward(q_h[qi], k_h[ki], v_h[ki], mask, scale)
                first = outs[qi] is None
                outs[qi], lses[qi] = (o, l) if first else blocks.merge(outs[qi], lses[qi], o, l)
            if step < plan.cp - 1:
                _wait(works)
                kv = nxt
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_h, q_h, dout_h, out_h, lse_h = (_halves(t) for t in (dq, q, dout, out, lse))
        kv, shapes = _pack(k, v), (k.shape, v.shape)
        dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=q.device)
        for step in range(plan.cp):
            src = (plan.rank - step) % plan.cp
            if step < plan.cp - 1:
                nxt, works = _ring_exchange(kv, plan, KV_TAG)
            k_h, v_h = (_halves(t) for t in _unpack(kv, shapes))
            dk_h, dv_h = (_halves(t) for t in _unpack(dkv, shapes))  # views: they add into dkv
            for qi, ki, a, b in _live_pairs(plan, src):
                mask = blocks.pair_mask(a, b, plan.chunk_docs(a), plan.chunk_docs(b))
                dq_p, dk_p, dv_p = blocks.block_backward(dout_h[qi], q_h[qi], k_h[ki], v_h[ki],
                                                         out_h[qi], lse_h[qi], mask, scale)
                dq_h[qi].add_(dq_p)
                dk_h[ki].add_(dk_p)
                dv_h[ki].add_(dv_p)
            if plan.cp > 1:  # the dK/dV accumulators follow their block; the last exchange: home
                dkv, grad_works = _ring_exchange(dkv, plan, GRAD_TAG)
                _wait(grad_works)
            if step < plan.cp - 1:
                _wait(works)
                kv = nxt
        dk, dv = _unpack(dkv, shapes)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"context-parallel attention: {q.shape[1]} query heads need a whole multiple "
                         f"of key/value heads (k has {k.shape[1]}, v {v.shape[1]})")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag part ([B, H, S / cp, D] queries, [B, Hkv, S / cp, D]
    keys and values) over the whole sequence; differentiable in q, k, v."""
    _check_heads(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, plan, scale)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, s, D] (my sequence part, all heads) -> [B, H / cp, cp * s, D] (every rank's parts in
    rank order, my heads: rank i holds heads i * H / cp ...)."""
    cp = dist.get_world_size(group)
    send = x.unflatten(1, (cp, x.shape[1] // cp)).movedim(1, 0).contiguous()  # [cp, B, h, s, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's part, my heads
    return recv.permute(1, 2, 0, 3, 4).flatten(2, 3)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [B, H / cp, cp * s, D] -> [B, H, s, D]."""
    cp = dist.get_world_size(group)
    send = y.unflatten(2, (cp, y.shape[2] // cp)).permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, h, s, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: my part of rank i's heads
    return recv.movedim(0, 1).flatten(1, 2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _heads_to_seq(dy.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, dx):
        return _seq_to_heads(dx.contiguous(), ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                      scale: float | None = None) -> torch.Tensor:
    """As `ring_attention`, by all-to-all: whole sequences of H / cp heads, SDPA, and back."""
    _check_heads(q, k, v)
    if q.shape[1] % plan.cp or k.shape[1] % plan.cp:
        raise ValueError(f"Ulysses attention: cp={plan.cp} must divide the query heads ({q.shape[1]}) "
                         f"and the key/value heads ({k.shape[1]}); use ring attention")
    qn, kn, vn = (from_zigzag(_SeqToHeads.apply(t, plan.group), plan.cp, dim=2) for t in (q, k, v))
    if plan.doc_ids is None:
        y = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, scale=scale,
                                           enable_gqa=kn.shape[1] != qn.shape[1])
    else:
        y = _documents_attention(qn, kn, vn, plan.doc_ids, scale)
    return _HeadsToSeq.apply(to_zigzag(y, plan.cp, dim=2), plan.group)


class _BlockAttention(torch.autograd.Function):
    """One whole block by attention_blocks (forward; backward recomputed from out and lse)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: blocks.BlockMask, scale: float):
        out, lse = blocks.block_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = blocks.block_backward(dout, q, k, v, out, lse, ctx.mask, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _documents_attention(q, k, v, doc_ids: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention within documents of whole sequences ([B, S] ids). On the CPU the fused
    block kernel (causal: it skips the upper half, which SDPA with an explicit mask computes);
    elsewhere SDPA with the boolean mask."""
    allowed = doc_ids[:, :, None] == doc_ids[:, None, :]
    if q.device.type == "cpu":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _BlockAttention.apply(q, k, v, blocks.BlockMask(causal=True, allowed=allowed), scale)
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & allowed[:, None], scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])
