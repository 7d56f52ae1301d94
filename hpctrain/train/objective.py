"""Training objectives (train.objective): what a step's loss is made of.

    pretrain  next-token cross-entropy on every token, the mean per micro-batch (as always)
    sft       next-token cross-entropy on the tokens of assistant turns only (a chat dataset's
              loss mask, `data_tools shard --format chat`): the other targets are ignored, and the
              loss is the mean over the trained tokens of the whole global batch (every
              micro-batch and data-parallel rank: hpctrain/parallel/token_mean.py)
    dpo       preference pairs and the DPO loss, with their own data, runner and trainer
              (hpctrain/train/dpo.py, hpctrain/parallel/dpo.py); listed so that every name is here

`OBJECTIVES` maps each name to what the trainer needs of it; the data path asks it whether
batches carry their loss mask (`masked_batch`), the runner whether it normalises by the global
count of trained tokens. Owns: the objectives' registry, their checks against the dataset and the
job's sync mode, and turning a batch + its loss mask into the batch the runner reads. It must
never read files (the dataset's readers do) nor run the loss (the runner does).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hpctrain import logs
from hpctrain.data.documents import DocumentBatch
from hpctrain.errors import ConfigError
from hpctrain.parallel.apply_context_parallel import local_batch
from hpctrain.parallel.batch_inputs import MaskedBatch, mask_targets
from hpctrain.parallel.zigzag import split_for_rank


@dataclass(frozen=True)
class Objective:
    name: str
    loss_mask: bool  # batches carry the dataset's loss mask (a chat dataset is required)
    token_mean: bool  # the loss is the mean over the global batch's trained tokens


OBJECTIVES = {
    "pretrain": Objective("pretrain", loss_mask=False, token_mean=False),
    "sft": Objective("sft", loss_mask=True, token_mean=True),
    # its own data (pairs), loss and runner: hpctrain/train/dpo.py; nothing of the above applies
    "dpo": Objective("dpo", loss_mask=False, token_mean=False),
}


def objective_of(cfg) -> Objective:
    return OBJECTIVES[cfg.train.objective]


def check_objective(cfg, has_loss_mask: bool, is_main: bool) -> Objective:
    """The run's objective, checked against its dataset (`has_loss_mask`: a chat dataset) and its
    sync mode; one line naming the key or the dataset where they do not go together."""
    objective = objective_of(cfg)
    if objective.loss_mask and not has_loss_mask:
        raise ConfigError(f"config key 'train.objective': {objective.name!r} trains on a loss "
                          f"mask, which dataset {cfg.data.path} has none of: shard it with "
                          f"`data_tools shard --format chat`")
    if objective.token_mean and cfg.sync.mode != "sync":
        raise ConfigError(f"config key 'train.objective': {objective.name!r} needs "
                          f"sync.mode = 'sync' (got {cfg.sync.mode!r}: its replicas do not "
                          f"step together, so no global count of trained tokens)")
    if has_loss_mask and not objective.loss_mask and is_main:
        logs.warning(f"warning: {cfg.data.path} is a chat dataset (loss mask of assistant turns) "
                     f"and train.objective = {objective.name!r} trains on every token: set "
                     f"train.objective = 'sft' to train on the assistant turns only")
    return objective


def masked_batch(batch, loss_mask: torch.Tensor, cp: tuple[int, int] = (1, 0)):
    """The micro-batch the runner reads, its targets where ``loss_mask[:, 1:]`` is 0 ignored:
    ``batch`` (tokens [mb, T+1] or a DocumentBatch, on the device) and its dataset loss mask
    ([mb, T+1], 1 on assistant tokens); `cp` (parallel.cp, this rank's cp index): with cp > 1 the
    rank's zig-zag LocalBatch with its part of the masked targets."""
    trained = loss_mask[:, 1:].to(device=_tokens(batch).device, dtype=torch.bool)
    cp_size, cp_rank = cp
    if cp_size > 1:
        local = local_batch(batch, cp_size, cp_rank)
        return replace(local, targets=mask_targets(local.targets,
                                                   split_for_rank(trained, cp_size, cp_rank)))
    return MaskedBatch(batch, mask_targets(_tokens(batch)[:, 1:], trained))


def _tokens(batch) -> torch.Tensor:
    return batch.tokens if isinstance(batch, DocumentBatch) else batch
