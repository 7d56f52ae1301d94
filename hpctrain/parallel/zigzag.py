"""The zig-zag (load-balanced causal) layout of context parallelism: a sequence of length S over cp
ranks is cut into 2·cp chunks of S / (2·cp) tokens, and rank r holds chunks r and 2·cp-1-r (an
early and a late chunk), so every rank has the same causal work (Megatron's and torchtitan's
load-balanced split).

Owns: the chunk order, splitting a batch's tensors (tokens, targets, positions, document ids) to a
rank's local part and gathering the parts back in natural order. "Rank-major" order is the
concatenation of every rank's local part in rank order: chunks 0, 2cp-1, 1, 2cp-2, ... It must
never compute attention (hpctrain/parallel/context_parallel.py) nor read data.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def chunk_order(cp: int) -> list[int]:
    """Global chunk indices in rank-major order: rank r's local part holds [2r] and [2r + 1]."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunks rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def _check_length(length: int, cp: int, what: str) -> None:
    if length % (2 * cp):
        raise ValueError(f"context parallelism: {what} of {length} tokens is not divisible by "
                         f"2 x cp = {2 * cp} (make the sequence length a multiple of {2 * cp})")


def to_zigzag(x: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """Natural order -> rank-major order along `dim` (the inverse of `from_zigzag`)."""
    _check_length(x.shape[dim], cp, "a sequence")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[c] for c in chunk_order(cp)], dim)


def from_zigzag(x: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank-major order (every rank's local part, concatenated in rank order) -> natural order."""
    _check_length(x.shape[dim], cp, "a gathered sequence")
    chunks = x.chunk(2 * cp, dim)
    where = {c: i for i, c in enumerate(chunk_order(cp))}
    return torch.cat([chunks[where[c]] for c in range(2 * cp)], dim)


def split_for_rank(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s local part of `x` (natural order along `dim`): chunks r and 2cp-1-r."""
    return to_zigzag(x, cp, dim).chunk(cp, dim)[rank]


@dataclass(frozen=True)
class LocalBatch:
    """One cp rank's part of a batch: tokens, targets, positions and document ids, [B, S / cp]
    each (positions: the tokens' global positions, for rope; doc_ids None without masking)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor | None = None


def split_batch(tokens: torch.Tensor, targets: torch.Tensor, cp: int, rank: int,
                positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> LocalBatch:
    """A [B, S] batch -> rank `rank`'s LocalBatch. `positions` default to 0..S-1 (a [S] or
    [B, S] tensor of rope positions, e.g. restarting per document, is split as given)."""
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    part = lambda t: split_for_rank(t, cp, rank, dim=t.dim() - 1)  # noqa: E731 (the sequence axis)
    return LocalBatch(part(tokens), part(targets), part(positions),
                      None if doc_ids is None else part(doc_ids))


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every cp rank's local part along `dim` -> the whole sequence in natural order (collective
    over `group`; not differentiable: for outputs, document ids and checks)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return from_zigzag(torch.cat(parts, dim), cp, dim)
