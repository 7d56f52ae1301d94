"""``shard``: turn text/JSONL inputs into an hpctrain dataset (HDF5 shards + manifest.json).

Owns: the shard pipeline — output-dir safety, planning (rank 0 enumerates documents and
assigns splits), parallel tokenization of disjoint contiguous document ranges, cutting each
split's token stream into shards, the MPI exchange that lets shard j be written by rank
j % world_size, and writing the manifest LAST.

Must never: let the output bytes depend on the number of ranks (tests run 1, 2 and 3 ranks and
compare bytes), write anything but temp files + os.replace into the output dir, write the
manifest before every shard is durable, or raise on one rank only (see mpiutil.agree).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from . import documents
from .format import (FORMAT_VERSION, MANIFEST_NAME, SHARD_RE, SPLITS, TMP_PREFIX, DataError, fsync_path,
                     read_manifest, shard_filename, token_dtype, write_manifest, write_shard)
from .mpiutil import SerialComm, agree, root_then_bcast, threads_per_rank
from .tokenizers import get_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 1234
BATCH_BYTES = 8 << 20  # text handed to the tokenizer per call
BATCH_DOCS = 512
_TAG_TOKENS, _TAG_DOCS = 11, 12


def _starts_in(starts: np.ndarray, a: int, b: int) -> np.ndarray:
    """The (sorted) document starts that fall in [a, b)."""
    return starts[np.searchsorted(starts, a, "left"):np.searchsorted(starts, b, "left")]


def prepare_output(out: str) -> None:
    """Create ``out`` or clear a previous hpctrain dataset there; refuse anything else.

    A directory is ours if every entry is manifest.json, a shard name or a temp file.  The old
    manifest is removed FIRST, so an interrupted rewrite is visibly incomplete."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(out, "exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    entries = sorted(os.listdir(out))
    foreign = [e for e in entries
               if not (e == MANIFEST_NAME or SHARD_RE.match(e) or e.startswith(TMP_PREFIX))]
    if foreign:
        raise DataError(out, f"not empty and not an hpctrain dataset (found {foreign[0]!r}); "
                             f"refusing to overwrite — use a new or empty directory")
    if MANIFEST_NAME in entries:
        try:
            read_manifest(out)
        except DataError as e:
            raise DataError(out, f"refusing to overwrite: {e}") from None
        os.unlink(os.path.join(out, MANIFEST_NAME))
        fsync_path(out)
    for e in entries:
        if e != MANIFEST_NAME:
            os.unlink(os.path.join(out, e))
    fsync_path(out)


def _plan(inputs, out, val_fraction, seed):
    prepare_output(out)
    table = documents.enumerate_documents(inputs)
    is_val = documents.assign_val(len(table), val_fraction, seed)
    return table, is_val


class _Buffer:
    """One split's tokens on this rank: pieces in document order + local doc start offsets."""

    def __init__(self):
        self.pieces, self.starts, self.n = [], [], 0

    def add(self, tokens: np.ndarray) -> None:
        self.starts.append(self.n)
        self.pieces.append(tokens)
        self.n += tokens.size

    def take(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        toks = np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype)
        starts = np.asarray(self.starts, dtype=np.int64)
        self.pieces, self.starts, self.n = [], [], 0
        return toks, starts


class _StreamWriter:
    """World size 1: write each split's shards as soon as they fill (memory ~ 1 shard/split)."""

    def __init__(self, emit, shard_tokens, dtype):
        self.emit, self.S, self.dtype = emit, shard_tokens, dtype
        self.buf = {s: _Buffer() for s in SPLITS}
        self.next_k = {s: 0 for s in SPLITS}

    def add(self, split, tokens):
        b = self.buf[split]
        b.add(tokens)
        if b.n >= self.S:
            self._flush(split, final=False)

    def _flush(self, split, final):
        toks, starts = self.buf[split].take(self.dtype)
        pos = 0
        while toks.size - pos >= self.S or (final and pos < toks.size):
            end = min(pos + self.S, toks.size)
            offs = _starts_in(starts, pos, end) - pos
            self.emit(split, self.next_k[split], toks[pos:end], offs)
            self.next_k[split] += 1
            pos = end
        if pos < toks.size:  # keep the partial shard, starts re-based to it
            b = self.buf[split]
            b.pieces, b.n = [toks[pos:]], toks.size - pos
            b.starts = (_starts_in(starts, pos, toks.size) - pos).tolist()

    def finish(self):
        for s in SPLITS:
            self._flush(s, final=True)


def _exchange_and_write(comm, emit, bufs, shard_tokens, dtype):
    """World size > 1: shard j (train shards first, then val) is written by rank j % size.

    Every rank Isends its slice of every shard it does not own (tokens + shard-relative doc
    offsets), then each owner receives its shards' slices in rank order.  Messages between a
    pair of ranks are posted and received in the same (split, shard) order, so MPI's
    non-overtaking rule matches them without per-shard tags."""
    rank, size = comm.Get_rank(), comm.Get_size()
    S = shard_tokens
    local = {s: bufs[s].take(dtype) for s in SPLITS}  # (tokens, local doc starts)
    counts = np.array(comm.allgather([local[s][0].size for s in SPLITS]), dtype=np.int64)
    starts = np.vstack([np.zeros((1, len(SPLITS)), np.int64), np.cumsum(counts, axis=0)])
    g0 = {s: int(starts[rank, si]) for si, s in enumerate(SPLITS)}  # my global token offset
    local = {s: (t, d + g0[s]) for s, (t, d) in local.items()}  # doc starts made global
    totals = starts[-1]
    n_shards = [(int(t) + S - 1) // S for t in totals]
    plan = []  # (split, k, global shard number j)
    for si, s in enumerate(SPLITS):
        plan += [(s, k, sum(n_shards[:si]) + k) for k in range(n_shards[si])]

    def piece(r, si, k):  # [a, b) of shard k of split si held by rank r, in global offsets
        a = max(k * S, int(starts[r, si]))
        b = min((k + 1) * S, int(starts[r + 1, si]))
        return a, b

    requests, first_err = [], None
    for s, k, j in plan:
        si = SPLITS.index(s)
        a, b = piece(rank, si, k)
        owner = j % size
        if a >= b or owner == rank:
            continue
        toks, gdocs = local[s]
        g = g0[s]
        offs = _starts_in(gdocs, a, b) - k * S
        requests.append(comm.Isend(toks[a - g:b - g], dest=owner, tag=_TAG_TOKENS))
        requests.append(comm.isend(offs, dest=owner, tag=_TAG_DOCS))
    for s, k, j in plan:
        if j % size != rank:
            continue
        si = SPLITS.index(s)
        lo, hi = k * S, min((k + 1) * S, int(totals[si]))
        out = np.empty(hi - lo, dtype=dtype)
        offs = []
        for r in range(size):
            a, b = piece(r, si, k)
            if a >= b:
                continue
            if r == rank:
                toks, gdocs = local[s]
                out[a - lo:b - lo] = toks[a - g0[s]:b - g0[s]]
                offs.append(_starts_in(gdocs, a, b) - lo)
            else:
                comm.Recv(out[a - lo:b - lo], source=r, tag=_TAG_TOKENS)
                offs.append(comm.recv(source=r, tag=_TAG_DOCS))
        if first_err is None:  # after a failure keep receiving (senders must complete)
            try:
                emit(s, k, out, np.concatenate(offs) if offs else np.zeros(0, np.int64))
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the exchange
                first_err = exc
    from mpi4py import MPI

    MPI.Request.Waitall(requests)
    if first_err is not None:
        raise first_err


def shard_dataset(inputs, output, tokenizer="gpt2", shard_tokens=DEFAULT_SHARD_TOKENS,
                  val_fraction=DEFAULT_VAL_FRACTION, seed=DEFAULT_SEED, comm=None,
                  progress=True, log=None) -> dict:
    """Build a dataset at ``output``; every rank of ``comm`` must call this with the same
    arguments.  Returns the manifest (on every rank).  Raises DataError (on all ranks)."""
    comm = comm if comm is not None else SerialComm()
    rank, size = comm.Get_rank(), comm.Get_size()
    log = log if log is not None else (lambda msg: print(msg, flush=True))
    t0 = time.perf_counter()
    for bad, where, why in ((not inputs, "--input", "at least one input path is required"),
                            (int(shard_tokens) < 1, "--shard-tokens", f"must be >= 1, got {shard_tokens}"),
                            (not 0.0 <= float(val_fraction) < 1.0, "--val-fraction",
                             f"must be in [0, 1), got {val_fraction}"),
                            (not 0 <= int(seed) < 2 ** 63, "--seed", f"must be in [0, 2**63), got {seed}")):
        if bad:
            err = DataError(where, why)
            err.collective = True  # every rank checks the same arguments and fails identically
            raise err
    shard_tokens, val_fraction, seed = int(shard_tokens), float(val_fraction), int(seed)
    tok = agree(comm, get_tokenizer, tokenizer)
    dtype = token_dtype(tok.vocab_size)
    table, is_val = root_then_bcast(comm, _plan, inputs, output, val_fraction, seed)
    t_plan = time.perf_counter()
    lo, hi = documents.balanced_ranges(table.length, size)[rank]
    threads = threads_per_rank(comm)
    entries = []

    def emit(split, k, toks, offs):
        path = os.path.join(output, shard_filename(split, k))
        entries.append(write_shard(path, toks, offs, split=split, tokenizer=tok.name,
                                   vocab_size=tok.vocab_size, eot_id=tok.eot_id))

    stream = _StreamWriter(emit, shard_tokens, dtype) if size == 1 else None
    bufs = {s: _Buffer() for s in SPLITS}

    def tokenize():
        bar = None
        if rank == 0 and progress:
            from tqdm import tqdm

            bar = tqdm(total=int(table.length[lo:hi].sum()), unit="B", unit_scale=True,
                       file=sys.stderr, disable=None, desc=f"tokenize (rank 0 of {size})")
        eot = np.array([tok.eot_id], dtype=dtype)
        batch, nbytes = [], 0

        def run(batch):
            arrs = tok.encode_batch([t for _, t in batch], num_threads=threads)
            for (i, _), ids in zip(batch, arrs):
                doc = np.concatenate([ids.astype(dtype), eot])
                split = "val" if is_val[i] else "train"
                if stream is not None:
                    stream.add(split, doc)
                else:
                    bufs[split].add(doc)
                if bar is not None:
                    bar.update(int(table.length[i]))

        for i, text in documents.iter_texts(table, lo, hi):
            batch.append((i, text))
            nbytes += len(text)
            if nbytes >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                run(batch)
                batch, nbytes = [], 0
        run(batch)
        if bar is not None:
            bar.close()
        if stream is not None:
            stream.finish()

    agree(comm, tokenize)
    if size > 1:
        agree(comm, _exchange_and_write, comm, emit, bufs, shard_tokens, dtype)
    gathered = comm.gather(entries, root=0)

    def finish():
        if rank != 0:
            return None
        order = {s: i for i, s in enumerate(SPLITS)}
        shards = sorted((e for part in gathered for e in part),
                        key=lambda e: (order[e["split"]], e["file"]))
        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "dtype": dtype.name, "seed": seed, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens,
            "n_documents": {"train": int((~is_val).sum()), "val": int(is_val.sum())},
            "n_tokens": {s: sum(e["n_tokens"] for e in shards if e["split"] == s) for s in SPLITS},
            "shards": shards,
        }
        fsync_path(output)  # the shard renames are durable before the manifest appears
        write_manifest(output, manifest)
        return manifest

    manifest = comm.bcast(agree(comm, finish), root=0)
    if rank == 0:
        t_end = time.perf_counter()
        dt, dw = t_end - t0, t_end - t_plan
        nt = manifest["n_tokens"]
        total = nt["train"] + nt["val"]
        count = {s: sum(1 for e in manifest["shards"] if e["split"] == s) for s in SPLITS}
        nd = manifest["n_documents"]
        log(f"sharded {nd['train'] + nd['val']} documents -> {output}\n"
            f"  train: {nd['train']} docs, {nt['train']:,} tokens, {count['train']} shards\n"
            f"  val:   {nd['val']} docs, {nt['val']:,} tokens, {count['val']} shards\n"
            f"  tokenizer {tok.name} (vocab {tok.vocab_size}, {dtype.name}), {size} rank(s), "
            f"{dt:.2f} s total (setup {t_plan - t0:.2f} s); tokenize + write "
            f"{dw:.2f} s = {total / max(dw, 1e-9):,.0f} tokens/s")
    return manifest
