"""Named validation sets during training (the `[[eval]]` tables): each evaluated every N steps,
at step 0 and at the end, and reported as `eval/<name>/loss` and `eval/<name>/bpb`.

What is measured is what `hpctrain eval CHECKPOINT --data SET --windows K` measures: K windows of
block_size + 1 tokens spread evenly over the split (np.linspace, as the val split's set is chosen),
the mean next-token cross entropy (loss) and the summed nats / ln 2 / the UTF-8 bytes of the
predicted tokens (bits per byte, bytes counted as hpctrain/evaluate.py counts them). The windows
are spread over the data-parallel ranks and run through the layout's evaluation forward, as the
val split's are (train.micro_batch_size windows per micro-batch, `max_batches` per rank).

Owns: opening each set, choosing its windows, its byte count (once, at start, every rank counting
a share) and its metrics. It never touches the training sampler or a random state, so training
numbers and data order are those of the same run without [[eval]] tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data_tools.format import shards_of
from hpctrain.config import Config, EvalSetConfig
from hpctrain.data import split_for_rank
from hpctrain.data.dataset import Dataset
from hpctrain.errors import ConfigError, UserError


@dataclass
class EvalSet:
    spec: EvalSetConfig
    reader: object          # the split's TokenShards / BlendShards at the model's block size
    interval: int           # steps between evaluations
    micro: int              # windows per micro-batch
    batches: int            # micro-batches per data-parallel rank
    indices: np.ndarray     # the set's windows (global indices into the split)
    tokens: int = 0         # predicted tokens of the whole set
    bytes: int = 0          # their UTF-8 bytes (0: the tokenizer's bytes are unknown)


def set_shape(n_windows: int, batches: int, micro: int, dp: int, block: int,
              max_tokens: int) -> tuple[int, int]:
    """(windows per micro-batch, micro-batches per rank) of a set: `batches` micro-batches of
    `micro` windows per rank, fewer windows per micro-batch where the split or max_tokens allow
    fewer, fewer micro-batches where fewer than one window each is left; (0, 0): not one window
    per rank."""
    total = min(n_windows, batches * micro * dp)
    if max_tokens:
        total = min(total, max_tokens // block)
    per_micro = total // (batches * dp)
    if per_micro == 0:
        return (1, total // dp) if total >= dp else (0, 0)
    return per_micro, batches


def open_set(i: int, spec: EvalSetConfig, cfg: Config, dp: int, tokenizer_name: str) -> EvalSet:
    """The [[eval]] table `i` opened: its split, interval and windows; ConfigError naming
    `eval[i].KEY` when the dataset does not suit the run."""
    where, block = f"eval[{i}]", cfg.model.block_size
    try:
        data = Dataset.open(spec.data)
    except (OSError, UserError) as e:  # data_tools' DataError is a UserError
        raise ConfigError(f"config key '{where}.data': {spec.data}: {e}") from None
    tok = data.tokenizer_info()
    if tok["name"] != tokenizer_name or tok["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"config key '{where}.data': {spec.data} was made with tokenizer "
                          f"{tok['name']} (vocab {tok['vocab_size']}), the training data with "
                          f"{tokenizer_name}; shard it with the training data's tokenizer")
    longest = max((e["n_tokens"] for e in shards_of(data.manifest, spec.split)), default=0)
    if longest <= block:
        raise ConfigError(f"config key '{where}.split': {spec.data} split '{spec.split}' has no "
                          f"window of {block + 1} tokens")
    reader = data.open_split(spec.split, block, optional=True)
    micro, batches = set_shape(len(reader), spec.max_batches or cfg.train.eval_batches,
                               cfg.train.micro_batch_size, dp, block, spec.max_tokens)
    if batches == 0:
        raise ConfigError(f"config key '{where}': {spec.data} split '{spec.split}' (max_tokens "
                          f"{spec.max_tokens}) gives fewer windows than the {dp} data-parallel ranks")
    indices = reader.eval_indices(micro * batches * dp)
    return EvalSet(spec, reader, spec.interval or cfg.train.eval_interval, micro, batches, indices,
                   tokens=indices.size * block)


def count_bytes(sets: list[EvalSet], tokenizer, vocab_size: int, comm) -> None:
    """Each set's UTF-8 bytes of its predicted tokens, as hpctrain eval counts them: every rank
    counts every world-th window, one all-reduce for all sets (the sets never change)."""
    from hpctrain.data.token_bytes import target_bytes, token_byte_lengths

    lengths = token_byte_lengths(tokenizer, max(vocab_size, tokenizer.vocab_size))
    rank, world = comm.Get_rank(), comm.Get_size()
    mine = np.zeros(len(sets), dtype=np.int64)
    for k, s in enumerate(sets):
        share = s.indices[rank::world]
        if share.size:
            mine[k] = target_bytes(s.reader.batch(share)[:, 1:], lengths, tokenizer)
    total = np.zeros_like(mine)
    comm.Allreduce(mine, total)  # MPI.SUM (the default op)
    for s, n in zip(sets, total):
        s.bytes = int(n)


class NamedEvals:
    """The [[eval]] sets of a run and their metrics at the steps they are due."""

    def __init__(self, cfg: Config, data, comm, sync, engine):
        """`data`: the run's TrainData (dp rank and size, batches on the device, the tokenizer);
        `comm`: the world's MPI communicator (the byte count's all-reduce); `sync`, `engine`: the
        run's strategy and step engine (the mean loss over every rank's batches in the run's
        layout, as the val split's; only where steps are collective: every rank evaluates)."""
        self.data, self.end, self.sync, self.engine = data, cfg.train.steps, sync, engine
        self.sets = [open_set(i, spec, cfg, data.dp_size, data.manifest["tokenizer"]["name"])
                     for i, spec in enumerate(cfg.eval)]  # none: data need not be a TrainData
        if self.sets:
            from data_tools.tokenizers import dataset_tokenizer

            count_bytes(self.sets, dataset_tokenizer(data.tokenizer_info, cfg.data.path),
                        cfg.model.vocab_size, comm)

    def due(self, step: int) -> list[EvalSet]:
        return [s for s in self.sets if step % s.interval == 0 or step == self.end]

    def metrics(self, step: int) -> dict:
        """{eval/<name>/loss, eval/<name>/bpb} of every set due at `step` (bpb only where bytes are
        known); every rank calls it at the same steps."""
        out = {}
        for s in self.due(step) if self.sync.collective_steps else ():
            parts = split_for_rank(s.indices, self.data.dp_rank, self.data.dp_size, s.micro, s.batches)
            batches = [self.data.device_batch(s.reader, p) for p in parts]
            loss = float(self.sync.mean_over_replicas(self.engine.eval_loss(batches)))
            out[f"eval/{s.spec.name}/loss"] = loss
            if s.bytes:
                out[f"eval/{s.spec.name}/bpb"] = loss * s.tokens / math.log(2) / s.bytes
        return out
