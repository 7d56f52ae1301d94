"""The trainer's view of the data: verified shards -> global sampler -> this rank's micro-batches.

Owns: checking the dataset once at start (checksums spread over all ranks, one agreed verdict), the
global batch size, and turning the sampler's global indices into this data-parallel rank's
micro-batches on the training device. The sample order itself lives in `hpctrain.data.sampler` and
does not depend on the data-parallel size.
"""
from __future__ import annotations

import numpy as np
import torch

from data_tools.format import FORMAT_PREFERENCE, DataError, shards_of
from hpctrain import logs
from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError
from hpctrain.data import make_sampler, split_for_rank
from hpctrain.data.dataset import Dataset
from hpctrain.data.documents import DocumentBatch, document_batch
from hpctrain.data.prefetch import DataFeed
from hpctrain.parallel.apply_context_parallel import local_batch
from hpctrain.train.objective import check_objective, masked_batch


def verify_everywhere(dataset: Dataset, ctx: DistContext, checksums: bool) -> None:
    """Each rank checks every world_size-th shard (of every component, for a blend); all ranks
    raise the same first problem."""
    n = len(dataset.manifest["shards"])
    mine = list(range(ctx.rank, n, ctx.world_size))
    problems = dataset.verify(mine, checksums) if mine else []
    every = [p for rank_problems in ctx.comm.allgather(problems) for p in rank_problems]
    if every:
        extra = (f" (+{len(every) - 1} more problems; run `data_tools verify {dataset.path}`)"
                 if len(every) > 1 else "")
        raise DataError(every[0] + extra)


class TrainData:
    def __init__(self, cfg: Config, ctx: DistContext, mesh: Mesh, grad_accum: int,
                 dataset: Dataset | None = None, cp: tuple[int, int] = (1, 0)):
        """`mesh`: where this rank reads (dp_rank / dp_size); `cp`: (parallel.cp, this rank's cp
        index): the ranks of a cp group read the same batches, each keeps its zig-zag part."""
        self.cfg, self.ctx = cfg, ctx
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp_size
        self.cp_size, self.cp_rank = cp
        t, m = cfg.train, cfg.model
        # data.path's manifest.json is read here, once (a blend: its components' shards flattened)
        self.dataset = dataset if dataset is not None else Dataset.open(cfg.data.path)
        self.manifest = self.dataset.manifest
        if self.manifest.get("format") == FORMAT_PREFERENCE:  # chosen AND rejected: never a corpus
            raise ConfigError(f"config key 'train.objective': {cfg.data.path} holds preference "
                              f"pairs (shard --format preference): set train.objective = \"dpo\"")
        self.feed = DataFeed.open(cfg, ctx, self.dataset)
        # With the node cache, sha256 is checked as each shard is staged (once per node), not here.
        if not self.feed.all_cached:  # the cache checks sha256 + layout as it stages each shard
            verify_everywhere(self.dataset, ctx, checksums=cfg.data.verify == "checksum")
        tok = self.manifest["tokenizer"]
        self.tokenizer_info = self.dataset.tokenizer_info()  # + its tokenizer.json, for `sample`
        if tok["vocab_size"] > m.vocab_size:
            raise ConfigError(f"config key 'model.vocab_size': {m.vocab_size} is smaller than the "
                              f"dataset's vocab size {tok['vocab_size']} ({cfg.data.path})")
        self.train = self.dataset.open_split(cfg.data.train_split, m.block_size,
                                             cache=self.feed.cache,
                                             range_checked=self.cfg.data.verify == "checksum")
        self.val = self._open_optional(cfg.data.val_split)
        # train.objective: sft reads the chat dataset's loss mask with each batch
        self.objective = check_objective(cfg, self.train.has_loss_mask, ctx.is_main)
        self.micro_batch, self.grad_accum = t.micro_batch_size, grad_accum  # the resolved one
        self.global_batch = self.micro_batch * self.grad_accum * self.dp_size
        self.sampler = make_sampler(self.train, self.global_batch, t.seed, cfg.data.shuffle,
                                    cfg.data.shuffle_block_shards)  # or a blend's mixture
        self.feed.bind(self, ctx.node_comm, self.val_indices, last_step=t.stop_at_step or t.steps)

    def _open_optional(self, split: str):
        """The validation split, or None (with a warning) when it is empty or too short."""
        entries = shards_of(self.manifest, split)
        longest = max((e["n_tokens"] for e in entries), default=0)
        if longest <= self.cfg.model.block_size:
            if self.ctx.is_main:
                logs.warning(f"warning: {self.cfg.data.path}: split '{split}' has no window of "
                             f"{self.cfg.model.block_size + 1} tokens; validation is off")
            return None
        val = self.dataset.open_split(split, self.cfg.model.block_size, optional=True,
                                      cache=self.feed.cache,
                                      range_checked=self.cfg.data.verify == "checksum")
        for note in getattr(val, "notes", ()) if self.ctx.is_main else ():
            logs.warning(f"warning: {note}")
        return val

    def _batch(self, reader, indices) -> torch.Tensor | DocumentBatch:
        """The windows ``indices`` of ``reader`` on the training device: a [mb, T+1] token tensor,
        or with data.document_mask a DocumentBatch (+ each token's document, and position); with
        train.objective = sft that batch with its loss mask (train/objective.py)."""
        tokens, d = reader.batch(indices), self.cfg.data
        pin = self.ctx.device.type == "cuda"
        if d.document_mask:
            batch = document_batch(tokens, reader.document_ids(indices), d.document_positions).to(
                self.ctx.device, pin)
        else:
            batch = tokens.pin_memory().to(self.ctx.device, non_blocking=True) if pin else tokens
        if self.objective.loss_mask:
            return masked_batch(batch, reader.loss_mask(indices), (self.cp_size, self.cp_rank))
        if self.cp_size > 1:  # parallel.cp: this rank's zig-zag part, with global positions
            return local_batch(batch, self.cp_size, self.cp_rank)
        return batch

    def device_batch(self, reader, indices) -> torch.Tensor | DocumentBatch:
        """The windows `indices` of any split's `reader` as training feeds them (named eval sets)."""
        return self._batch(reader, indices)

    def next_train_micro_batches(self, at: int | None = None) -> list[torch.Tensor | DocumentBatch]:
        """This rank's micro-batches of the next step, or of step `at` (a batch claimed out of
        order; the sampler is left after it)."""
        t0 = self.feed.begin_step()
        if at is None:
            indices = self.sampler.next_indices()
        else:
            indices = self.sampler.indices_at(at)
            self.sampler.seek(at + 1)
        parts = split_for_rank(indices, self.dp_rank, self.dp_size, self.micro_batch, self.grad_accum)
        out = [self._batch(self.train, p) for p in parts]
        self.feed.end_step(t0)
        return out

    def step_metrics(self) -> dict:
        """Data metrics of the step just taken (every rank calls this once per step)."""
        return self.feed.metrics()

    def _eval_micro(self) -> int:
        """Samples per evaluation micro-batch (0: the validation split is too small)."""
        n_eval = self.cfg.train.eval_batches
        total = min(len(self.val), n_eval * self.micro_batch * self.dp_size)
        return total // (n_eval * self.dp_size)

    def val_indices(self) -> np.ndarray | None:
        """The fixed evaluation set (global val sample indices), or None when there is none."""
        if self.val is None or self._eval_micro() == 0:
            return None
        return self.val.eval_indices(self._eval_micro() * self.cfg.train.eval_batches * self.dp_size)

    def val_micro_batches(self) -> list[torch.Tensor] | None:
        """The same evaluation set every time: `eval_batches` micro-batches per rank spread evenly
        over the validation split (independent of the step, so val losses are comparable)."""
        if self.val is None:
            return None
        self.feed.ensure_started()
        indices = self.val_indices()
        if indices is None:
            return None
        parts = split_for_rank(indices, self.dp_rank, self.dp_size, self._eval_micro(),
                               self.cfg.train.eval_batches)
        return [self._batch(self.val, p) for p in parts]
