"""`hpctrain eval RUN_OR_HF_DIR --data DATASET`: a model's loss, perplexity and bits per byte over a
dataset split, on one rank or many (`mpiexec -n N`: each rank takes every N-th window, the sums
meet in one MPI all-reduce).

What is measured: windows of block_size + 1 tokens, as training reads them (hpctrain/data: every
window of the split, or `--windows K` spread evenly over it exactly as training's validation set of
K windows is chosen), the next-token cross entropy of each window's block_size predictions (fp32
logits), summed in float64. loss = nats per predicted token; perplexity = exp(loss); bits per
byte = the summed nats / ln 2 / the UTF-8 bytes of the predicted tokens. Bytes are exact per token
for the genuine GPT-2 BPE (its tiktoken token bytes) and the bytes tokenizer; for any other
tokenizer each window's predicted tokens are decoded and encoded again (a character cut by a
window's edges counts as U+FFFD's 3 bytes: the report says which way was taken).

Owns: choosing windows, the sums and their report. The model and tokenizer come from
`hpctrain.load` (hpctrain/api.py), the windows from the dataset readers (hpctrain/data).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.data.token_bytes import target_bytes, token_byte_lengths  # noqa: F401 (tests read it here)
from hpctrain.errors import UserError

EXACT_BYTES, DECODED_BYTES = "token bytes", "decoded windows"
TOKENIZER_PROBE = "Tokens 12345, ümlauts and\ttabs:  the model's ids and the data's must agree.\n"


@dataclass
class EvalResult:
    nats: float        # summed next-token cross entropy (natural log)
    tokens: int        # predicted tokens
    bytes: int         # UTF-8 bytes of the predicted tokens (0: no tokenizer known)
    windows: int
    bytes_method: str  # EXACT_BYTES | DECODED_BYTES | "" (no tokenizer)

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        return self.nats / math.log(2) / self.bytes if self.bytes else None

    def report(self) -> dict:
        return {**asdict(self), "loss": self.loss, "perplexity": self.perplexity,
                "bits_per_byte": self.bits_per_byte}


def window_indices(n_windows: int, wanted: int | None, rank: int, world: int) -> np.ndarray:
    """This rank's windows: every window (wanted None / 0) or `wanted` spread evenly over the split
    (training's choice of its validation set), every world-th from the rank-th."""
    if wanted:
        every = np.linspace(0, n_windows - 1, int(wanted)).astype(np.int64)
    else:
        every = np.arange(n_windows, dtype=np.int64)
    return every[rank::world]


@torch.no_grad()
def evaluate(lm, split_reader, indices: np.ndarray, batch_size: int, tokenizer=None) -> EvalResult:
    """Sum of the cross entropy over the windows `indices` of `split_reader`, `batch_size` at a
    time, with `lm` (a LoadedModel) on its device; bytes counted with `tokenizer` (the dataset's;
    None: no bytes)."""
    lengths = token_byte_lengths(tokenizer, max(lm.vocab_size, tokenizer.vocab_size)) if tokenizer is not None else None
    method = "" if tokenizer is None else (EXACT_BYTES if lengths is not None else DECODED_BYTES)
    nats, tokens, n_bytes = 0.0, 0, 0
    for start in range(0, len(indices), batch_size):
        batch = split_reader.batch(indices[start:start + batch_size])
        inputs, targets = batch[:, :-1].to(lm.device), batch[:, 1:].to(lm.device)
        logits = lm.model(inputs).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        nats += float(loss.double().sum())
        tokens += targets.numel()
        if tokenizer is not None:
            n_bytes += target_bytes(targets, lengths, tokenizer)
    return EvalResult(nats, tokens, n_bytes, len(indices), method)


def reduce_over_ranks(result: EvalResult, comm) -> EvalResult:
    """Every rank's sums added (one all-reduce); windows counted over all ranks."""
    if comm is None or comm.Get_size() == 1:
        return result
    mine = np.array([result.nats, result.tokens, result.bytes, result.windows], dtype=np.float64)
    total = np.empty_like(mine)
    from mpi4py import MPI

    comm.Allreduce(mine, total, op=MPI.SUM)
    return EvalResult(float(total[0]), int(total[1]), int(total[2]), int(total[3]), result.bytes_method)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpctrain eval",
        description="Loss, perplexity and bits per byte of a model over a dataset split. Under "
                    "`mpiexec -n N` (or srun) each rank evaluates every N-th window; the numbers "
                    "equal one rank's.")
    p.add_argument("model", help="a run directory (its newest intact checkpoint, or --step), a "
                                 "step_N checkpoint folder, or a Hugging Face model folder")
    p.add_argument("--data", required=True, help="a sharded dataset (`data_tools shard` output) "
                                                 "made with the model's tokenizer")
    p.add_argument("--split", default="val", choices=("train", "val"), help="default: val")
    p.add_argument("--step", type=int, help="with a run directory: this step's checkpoint")
    p.add_argument("--block-size", type=int, help="tokens a window predicts (default: the model's "
                                                  "block_size; at most that)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--windows", type=int, default=0,
                   help="evaluate K windows spread evenly over the split, as training's validation "
                        "picks train.eval_batches x micro-batch x dp of them (default 0: every window)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: CUDA when available; under "
                                    "mpiexec each rank takes its node-local GPU)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    return p


def _check_args(args) -> None:
    for key in ("block_size", "batch_size"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise UserError(f"--{key.replace('_', '-')} {value}: must be >= 1")
    if args.windows < 0:
        raise UserError(f"--windows {args.windows}: must be >= 0 (0: every window)")


def _open_split(args, lm):
    """(The dataset's tokenizer, its split reader at the evaluated block size); UserError when the
    dataset does not suit the model (other token ids, a larger vocabulary, longer windows)."""
    from hpctrain.data.dataset import Dataset

    data = Dataset.open(args.data)
    block = args.block_size or lm.block_size
    if block > lm.block_size:
        raise UserError(f"--block-size {block}: more than the model's block_size {lm.block_size}")
    tok = data.tokenizer_info()
    if tok["vocab_size"] > lm.vocab_size:
        raise UserError(f"{args.data}: vocabulary {tok['vocab_size']} exceeds the model's "
                        f"{lm.vocab_size}; shard the text with the model's tokenizer")
    from data_tools.tokenizers import dataset_tokenizer

    data_tokenizer = dataset_tokenizer(tok, args.data)
    if lm.tokenizer is not None and list(lm.encode(TOKENIZER_PROBE)) != \
            [int(i) for i in data_tokenizer.encode(TOKENIZER_PROBE)]:
        raise UserError(f"{args.data}: made with tokenizer {tok['name']}, whose ids differ from the "
                        f"model's ({lm.tokenizer.name}); shard the text with the model's tokenizer")
    return data_tokenizer, data.open_split(args.split, block)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)

    from mpi4py import MPI

    from hpctrain.api import load_as
    from hpctrain.distributed.bootstrap import share_node_cores

    comm = MPI.COMM_WORLD  # no process group: each rank loads the whole model, alone (hpctrain.load)
    rank, world = comm.Get_rank(), comm.Get_size()
    local_rank = share_node_cores(comm)
    device = args.device
    if device is None and torch.cuda.is_available():
        device = f"cuda:{local_rank % torch.cuda.device_count()}"
    lm = load_as(args.model, device=device, step=args.step)
    tokenizer, split = _open_split(args, lm)
    t0 = time.perf_counter()
    indices = window_indices(len(split), args.windows, rank, world)
    result = reduce_over_ranks(evaluate(lm, split, indices, args.batch_size, tokenizer), comm)
    if rank == 0:
        _print(result, args, lm, split, time.perf_counter() - t0, world)
    return 0


def _print(result: EvalResult, args, lm, split, seconds: float, ranks: int) -> None:
    report = {"model": str(lm.path), "step": lm.step, "data": args.data, "split": args.split,
              "block_size": split.block_size, "ranks": ranks, **result.report(),
              "seconds": round(seconds, 3)}
    if args.json:
        print(json.dumps(report))
        return
    bpb = f"{result.bits_per_byte:.4f}" if result.bits_per_byte is not None else "n/a"
    print(f"# {lm.path}" + (f" (step {lm.step})" if lm.step is not None else "")
          + f" on {args.data} [{args.split}], {result.windows} windows of {split.block_size} "
          f"tokens, {ranks} rank(s), {seconds:.1f} s")
    print(f"loss {result.loss:.6f}  perplexity {result.perplexity:.3f}  bits/byte {bpb} "
          f"({result.tokens:,} tokens, {result.bytes:,} bytes by {result.bytes_method or 'n/a'})")
