"""train.objective = "dpo": the training loop (train/loop.py's Trainer) on preference pairs with the
DPO loss (hpctrain/parallel/dpo.py).

What differs from pretraining, and nothing else:
  data       a `shard --format preference` dataset: the global sampler's indices are pair numbers,
             each data-parallel rank takes its contiguous part of a step's pairs (a pair is never
             split), micro-batches of train.micro_batch_size pairs (hpctrain/data/pairs.py)
  reference  the log-probs of every training pair's chosen and rejected completion under the
             INITIAL model, computed once before the first step (blocks of micro_batch_size
             pairs spread over the ranks, then all-gathered) and stored in
             <run.dir>/dpo_reference.npy; a resumed run reads that file (a reference model held
             beside the policy would cost its memory and a second forward every step)
  step       the DPO loss, its rewards in metrics.jsonl (rewards/chosen, rewards/rejected,
             rewards/margins, rewards/accuracies: TRL's names)

Owns: those three.  Must never: change what pretraining does (it never imports this module) or
run on a layout it was not tested on (data parallel with DDP, sync.mode = "sync", refused in one
line otherwise).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from hpctrain import logs
from hpctrain.data import split_for_rank
from hpctrain.data.dataset import Dataset
from hpctrain.data.pairs import PreferencePairs
from hpctrain.data.sampler import GlobalSampler
from hpctrain.errors import ConfigError
from hpctrain.parallel.dpo import REWARD_KEYS, DpoRunner, sequence_logps
from hpctrain.train.data import verify_everywhere
from hpctrain.train.loop import Trainer
from hpctrain.train.objective import OBJECTIVES

REFERENCE_FILE = "dpo_reference.npy"


def check_dpo_config(cfg) -> None:
    """The layouts and settings DPO runs with; ConfigError naming the first other key."""
    p = cfg.parallel
    for key, value, want in (("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1),
                             ("parallel.cp", p.cp, 1), ("parallel.ep", p.ep, 1),
                             ("parallel.data_parallel", p.data_parallel, "ddp"),
                             ("sync.mode", cfg.sync.mode, "sync"),
                             ("train.loss_chunk", cfg.train.loss_chunk, 0)):
        if value != want:
            raise ConfigError(f"config key '{key}': {value!r} with train.objective = 'dpo', which "
                              f"runs with {key} = {want!r} only so far")
    if not cfg.dpo.beta > 0:
        raise ConfigError(f"config key 'dpo.beta': {cfg.dpo.beta} must be > 0")
    if cfg.eval:  # the named sets' loss is the next-token one, not DPO's (no validation loss yet)
        raise ConfigError(f"config key 'eval[0].name': [[eval]] tables ({cfg.eval[0].name!r}) with "
                          f"train.objective = 'dpo': not supported yet; remove them")


class DpoData:
    """TrainData's interface (train/data.py) over a preference dataset's pairs."""

    def __init__(self, cfg, ctx, position, grad_accum: int):
        self.cfg, self.ctx, self.device = cfg, ctx, ctx.device
        self.dp_rank, self.dp_size = position.dp_rank, position.dp_size
        dataset = Dataset.open(cfg.data.path)
        verify_everywhere(dataset, ctx, checksums=cfg.data.verify == "checksum")
        self.tokenizer_info = dataset.tokenizer_info()
        if self.tokenizer_info["vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(f"config key 'model.vocab_size': {cfg.model.vocab_size} is smaller "
                              f"than the dataset's vocab size {self.tokenizer_info['vocab_size']}")
        self.train = PreferencePairs(cfg.data.path, dataset.manifest, cfg.data.train_split,
                                     cfg.model.block_size)
        self.micro_batch, self.grad_accum = cfg.train.micro_batch_size, grad_accum
        self.global_batch = self.micro_batch * grad_accum * self.dp_size  # pairs per step
        self.sampler = GlobalSampler(len(self.train), self.global_batch, cfg.train.seed)
        self.objective = OBJECTIVES["dpo"]  # what the loop asks of TrainData's (train/objective.py)

    def next_train_micro_batches(self, at: int | None = None) -> list:
        indices = self.sampler.next_indices()
        parts = split_for_rank(indices, self.dp_rank, self.dp_size, self.micro_batch, self.grad_accum)
        return [self.train.batch(p).to(self.device) for p in parts]

    def step_metrics(self) -> dict:
        return {}

    def val_micro_batches(self) -> None:
        return None  # no validation loss for DPO yet: train.eval_interval has nothing to run


def reference_logps(trainer) -> torch.Tensor:
    """[pairs, 2] fp32 on the device: the initial model's chosen and rejected log-probs of every
    training pair, read from <run.dir>/dpo_reference.npy or computed now (collective) and saved.
    Called before any checkpoint is loaded, so the model is the initial one either way."""
    path = Path(trainer.cfg.run.dir) / REFERENCE_FILE
    pairs = trainer.data.train
    if path.exists():
        table = np.load(path)
        if table.shape != (len(pairs), 2) or table.dtype != np.float32:
            raise ConfigError(f"{path}: {table.dtype}{list(table.shape)}, not float32 "
                              f"[{len(pairs)}, 2] for data.path's pairs: another dataset? Use a "
                              f"new run.dir, or delete it only if no checkpoint is in run.dir")
        return torch.from_numpy(table).to(trainer.ctx.device)
    table = _computed_reference(trainer, pairs)
    if trainer.ctx.is_main:
        tmp = path.with_name(f".tmp-{os.getpid()}-{REFERENCE_FILE}")
        with open(tmp, "wb") as f:
            np.save(f, table)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        logs.info(f"dpo: reference log-probs of {len(pairs)} pairs -> {path}")
    trainer.ctx.comm.Barrier()
    return torch.from_numpy(table).to(trainer.ctx.device)


@torch.no_grad()
def _computed_reference(trainer, pairs: PreferencePairs) -> np.ndarray:
    """Blocks of micro_batch_size consecutive pairs (the same blocks on any number of ranks, so the
    numbers are too), block k on dp rank k mod dp, all-gathered."""
    module, mb = trainer.layout.module, trainer.cfg.train.micro_batch_size
    dp_rank, dp_size = trainer.data.dp_rank, trainer.data.dp_size
    module.eval()
    mine = {}
    for start in range(dp_rank * mb, len(pairs), dp_size * mb):
        batch = pairs.batch(np.arange(start, min(start + mb, len(pairs)))).to(trainer.ctx.device)
        with trainer.engine.autocast:
            logits = module(batch.tokens[:, :-1])
        logps = sequence_logps(logits, batch.tokens[:, 1:], batch.mask).cpu().numpy()
        mine[start] = np.stack(np.split(logps, 2), axis=1)
    table = np.zeros((len(pairs), 2), np.float32)
    for part in trainer.ctx.comm.allgather(mine):
        for start, rows in part.items():
            table[start:start + rows.shape[0]] = rows
    return table


class DpoTrainer(Trainer):
    """The Trainer with DpoData, the reference log-probs and DpoRunner in its step engine."""

    def __init__(self, cfg, ctx):
        check_dpo_config(cfg)
        super().__init__(cfg, ctx)
        self.reference = None  # set by maybe_resume, before the first step
        self.engine.runner = DpoRunner(self.layout, cfg.dpo.beta,
                                       lambda pairs: self.reference[torch.from_numpy(pairs)])
        self.hooks.add("after_step", self._record_rewards)

    def _open_data(self) -> DpoData:
        return DpoData(self.cfg, self.ctx, self.plan.position, self.plan.train.grad_accum)

    def maybe_resume(self) -> None:
        self.reference = reference_logps(self)  # the initial model's: before a checkpoint loads
        super().maybe_resume()

    def _record_rewards(self, rec: dict) -> None:
        """The step's rewards, device tensors until the log step reads them (train/step_log.py)."""
        rec.update(zip(REWARD_KEYS, self.engine.runner.rewards.clone().unbind()))
