"""Document boundaries inside training windows (data.document_mask, data.document_positions).

A shard's ``doc_offsets`` (data_tools/format.py: the offsets of the documents that begin in it,
written by `shard` and checked by `verify`) say where each document starts; a window of
block_size + 1 tokens at shard offset ``a`` gets, per token, the number of its document counted
from the window's first one (0, 1, 2, ...: two searchsorted on the offsets, then a cumulative
sum), and optionally each token's position inside its document (0 at a document's first token, or
at the window's start for the document the window begins inside).

Owns: ``DocumentBatch`` (a micro-batch with its document ids) and the two per-window arrays. Must
never read files (the readers hand it the offsets) or decide the sample order.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class DocumentBatch(NamedTuple):
    """A micro-batch under data.document_mask: the tokens [mb, T+1] as without it, each token's
    document number [mb, T+1] and, with data.document_positions, its position in the document
    [mb, T+1] (else None). The model gets the first T columns of each (the inputs)."""
    tokens: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor | None

    def to(self, device: torch.device, pin: bool) -> "DocumentBatch":
        """On ``device`` (through pinned memory when ``pin``: a CUDA device)."""
        move = ((lambda t: t.pin_memory().to(device, non_blocking=True)) if pin
                else (lambda t: t.to(device)))
        return DocumentBatch(*(None if t is None else move(t) for t in self))


def window_doc_ids(doc_starts: np.ndarray, start: int, width: int, out: np.ndarray) -> None:
    """``out`` [width] <- the document number of tokens start .. start+width-1 of a shard whose
    documents begin at the sorted offsets ``doc_starts`` (0 = the document at ``start``)."""
    lo, hi = np.searchsorted(doc_starts, (start + 1, start + width))
    out[:] = 0
    out[doc_starts[lo:hi] - start] = 1  # a document starts at this token
    np.cumsum(out, out=out)


def positions_in_documents(doc_ids: np.ndarray) -> np.ndarray:
    """[B, W] document numbers (non-decreasing per row) -> each token's position in its document,
    counted from 0 at the document's first token in the row."""
    index = np.broadcast_to(np.arange(doc_ids.shape[1], dtype=np.int64), doc_ids.shape)
    first = np.ones(doc_ids.shape, dtype=bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - np.maximum.accumulate(np.where(first, index, 0), axis=1)


def document_batch(tokens: torch.Tensor, doc_ids: np.ndarray, with_positions: bool) -> DocumentBatch:
    """A DocumentBatch of ``tokens`` and their per-token document numbers."""
    positions = torch.from_numpy(positions_in_documents(doc_ids)) if with_positions else None
    return DocumentBatch(tokens, torch.from_numpy(doc_ids), positions)
