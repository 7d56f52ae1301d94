"""What a micro-batch gives the model: (inputs, the model's keywords, targets), for every kind of
micro-batch the data path makes: tokens [mb, T+1]; a DocumentBatch (data.document_mask); a cp
rank's LocalBatch (parallel.cp > 1); a MaskedBatch (train.objective = sft: one of the first two
with its untrained targets set to IGNORE_INDEX).

Owns: those batch kinds' view as model inputs and masking targets. It must never read data, run
the model or compute a loss.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hpctrain.data.documents import DocumentBatch
from hpctrain.parallel.loss import IGNORE_INDEX
from hpctrain.parallel.zigzag import LocalBatch


class MaskedBatch(NamedTuple):
    """A micro-batch (tokens [mb, T+1] or a DocumentBatch) and its targets [mb, T] with the
    untrained ones set to IGNORE_INDEX (the model's inputs are the batch's, unchanged)."""
    batch: object
    targets: torch.Tensor


def mask_targets(targets: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """`targets` with IGNORE_INDEX where `trained` (bool, same shape) is False."""
    return targets.masked_fill(~trained, IGNORE_INDEX)


def model_inputs(batch: torch.Tensor | DocumentBatch | LocalBatch) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(inputs [mb, T], the model's keywords, targets [mb, T]) of a micro-batch: tokens [mb, T+1],
    or a DocumentBatch (data.document_mask: + doc_ids, and positions with data.document_positions),
    or a cp rank's LocalBatch (parallel.cp > 1: its part, with the tokens' global positions), or
    a MaskedBatch (train.objective = sft: one of those with its untrained targets ignored)."""
    if isinstance(batch, MaskedBatch):
        inputs, keywords, _ = model_inputs(batch.batch)
        return inputs, keywords, batch.targets
    if isinstance(batch, LocalBatch):
        keywords = {"positions": batch.positions}
        if batch.doc_ids is not None:
            keywords["doc_ids"] = batch.doc_ids
        return batch.tokens, keywords, batch.targets
    if not isinstance(batch, DocumentBatch):
        return batch[:, :-1], {}, batch[:, 1:]
    keywords = {"doc_ids": batch.doc_ids[:, :-1]}
    if batch.positions is not None:
        keywords["positions"] = batch.positions[:, :-1]
    return batch.tokens[:, :-1], keywords, batch.tokens[:, 1:]
