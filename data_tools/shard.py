"""``shard``: turn text/JSONL inputs into an hpctrain dataset (HDF5 shards + manifest.json).

Owns: the shard pipeline — output-dir safety, planning (rank 0 enumerates documents and
assigns splits), parallel tokenization of disjoint contiguous document ranges, cutting each
split's token stream into shards, the MPI exchange (round by round, so memory stays bounded) that
lets each shard be written by its owner rank, and writing the manifest LAST.

Must never: let the output bytes depend on the number of ranks (tests run 1, 2 and 3 ranks and
compare bytes), write anything but temp files + os.replace into the output dir, write the
manifest before every shard is durable, or raise on one rank only (see mpiutil.agree).
"""
from __future__ import annotations

import os
import shutil
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
TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer, copied beside the shards
ROUND_BYTES = 64 << 20  # MPI: text each rank tokenizes per round (bounds memory, see docs/data.md)
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
               if not (e in (MANIFEST_NAME, TOKENIZER_FILE) or SHARD_RE.match(e)
                       or e.startswith(TMP_PREFIX))]
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
        if e not in (MANIFEST_NAME, TOKENIZER_FILE):  # the tokenizer may be the one in use
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


def round_cuts(length: np.ndarray, per_round: int) -> list[tuple[int, int]]:
    """Cut documents into consecutive rounds of about ``per_round`` bytes of text (document i
    joins round floor(bytes before i / per_round)).  Only bounds memory; never changes output."""
    before = np.cumsum(length, dtype=np.int64) - length
    rnd = before // max(1, int(per_round))
    cuts = [0] + (np.flatnonzero(np.diff(rnd)) + 1).tolist() + [int(length.size)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


class _RoundExchange:
    """World size > 1, one round at a time: every rank sends its slice of every shard the round
    touches to the shard's owner (train shard k -> rank k % size, val shard k -> rank
    (k + size // 2) % size); an owner keeps a shard's buffer only until it is full, then writes
    it.  Messages between a pair of ranks are posted and received in the same (split, shard)
    order within a round (and rounds end with Waitall), so MPI's non-overtaking rule matches
    them without per-shard tags."""

    def __init__(self, comm, emit, shard_tokens, dtype):
        self.comm, self.emit, self.S, self.dtype = comm, emit, shard_tokens, dtype
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.base = np.zeros(len(SPLITS), np.int64)  # tokens of each split before this round
        self.open = {}  # (split, k) -> [buffer, [doc offset arrays], tokens filled]

    def owner(self, si: int, k: int) -> int:
        return (k + si * (self.size // 2)) % self.size

    def round(self, bufs, final: bool) -> None:
        from mpi4py import MPI

        comm, rank, size, S = self.comm, self.rank, self.size, self.S
        local = {s: bufs[s].take(self.dtype) for s in SPLITS}  # (tokens, local doc starts)
        counts = np.array(comm.allgather([local[s][0].size for s in SPLITS]), dtype=np.int64)
        starts = self.base + np.vstack([np.zeros((1, len(SPLITS)), np.int64),
                                        np.cumsum(counts, axis=0)])
        g0 = {s: int(starts[rank, si]) for si, s in enumerate(SPLITS)}
        local = {s: (t, d + g0[s]) for s, (t, d) in local.items()}  # doc starts made global

        def piece(r, si, k):  # [a, b) of shard k of split si held by rank r, global offsets
            return max(k * S, int(starts[r, si])), min((k + 1) * S, int(starts[r + 1, si]))

        plan = [(si, s, k) for si, s in enumerate(SPLITS) if starts[-1, si] > starts[0, si]
                for k in range(int(starts[0, si]) // S, (int(starts[-1, si]) - 1) // S + 1)]
        requests, first_err = [], None
        for si, s, k in plan:
            a, b = piece(rank, si, k)
            if a < b and self.owner(si, k) != rank:
                toks, gdocs = local[s]
                requests.append(comm.Isend(toks[a - g0[s]:b - g0[s]], dest=self.owner(si, k),
                                           tag=_TAG_TOKENS))
                requests.append(comm.isend(_starts_in(gdocs, a, b) - k * S,
                                           dest=self.owner(si, k), tag=_TAG_DOCS))
        for si, s, k in plan:
            if self.owner(si, k) != rank:
                continue
            slot = self.open.setdefault((s, k), [np.empty(S, dtype=self.dtype), [], 0])
            out, lo = slot[0], k * S
            for r in range(size):
                a, b = piece(r, si, k)
                if a >= b:
                    continue
                if r == rank:
                    toks, gdocs = local[s]
                    out[a - lo:b - lo] = toks[a - g0[s]:b - g0[s]]
                    slot[1].append(_starts_in(gdocs, a, b) - lo)
                else:
                    comm.Recv(out[a - lo:b - lo], source=r, tag=_TAG_TOKENS)
                    slot[1].append(comm.recv(source=r, tag=_TAG_DOCS))
                slot[2] += b - a
            if slot[2] == S:
                first_err = self._write(s, k, first_err)
        if final:  # the short last shard of each split
            for s, k in sorted(self.open):
                first_err = self._write(s, k, first_err)
        MPI.Request.Waitall(requests)
        self.base = starts[-1].copy()
        if first_err is not None:
            raise first_err

    def _write(self, s, k, first_err):
        out, offs, n = self.open.pop((s, k))
        if first_err is None:  # after a failure keep receiving (senders must complete)
            try:
                self.emit(s, k, out[:n], np.concatenate(offs) if offs else np.zeros(0, np.int64))
            except Exception as exc:  # noqa: BLE001 - re-raised after the exchange
                return exc
        return first_err


def shard_dataset(inputs, output, tokenizer="gpt2", shard_tokens=DEFAULT_SHARD_TOKENS,
                  val_fraction=DEFAULT_VAL_FRACTION, seed=DEFAULT_SEED, comm=None,
                  progress=True, log=None, round_bytes=ROUND_BYTES, filter=False,
                  min_chars=1) -> dict:
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
    report = None
    if filter:  # drop bad/short/duplicate documents, then number and split the kept ones
        from .validate import describe_report, filter_documents, subset

        keep, report = filter_documents(table, min_chars, comm)
        table = subset(table, keep)
        is_val = documents.assign_val(len(table), val_fraction, seed)
        if rank == 0:
            log("filter: " + describe_report(report, min_chars))
    t_plan = time.perf_counter()
    # Rounds of ~ROUND_BYTES of text per rank bound memory (MPI); 1 rank streams in one round.
    rounds = round_cuts(table.length, round_bytes * size) if size > 1 else [(0, len(table))]
    ranges = [(a + lo, a + hi) for a, b in rounds
              for lo, hi in [documents.balanced_ranges(table.length[a:b], size)[rank]]]
    threads = threads_per_rank(comm)
    entries = []

    def emit(split, k, toks, offs):
        path = os.path.join(output, shard_filename(split, k))
        entries.append(write_shard(path, toks, offs, split=split, tokenizer=tok.name,
                                   vocab_size=tok.vocab_size, eot_id=tok.eot_id))

    stream = _StreamWriter(emit, shard_tokens, dtype) if size == 1 else None
    exchange = _RoundExchange(comm, emit, shard_tokens, dtype) if size > 1 else None
    bufs = {s: _Buffer() for s in SPLITS}
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=int(sum(table.length[lo:hi].sum() for lo, hi in ranges)), unit="B",
                   unit_scale=True, file=sys.stderr, disable=None,
                   desc=f"tokenize (rank 0 of {size})")

    def tokenize(lo, hi):
        batch, nbytes = [], 0

        def run(batch):
            arrs = tok.encode_batch([t for _, t in batch], num_threads=threads)
            for (i, _), ids in zip(batch, arrs):
                doc = np.empty(ids.size + 1, dtype)  # one copy: ids cast in place, then end-of-text
                doc[:-1] = ids
                doc[-1] = tok.eot_id
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
        if stream is not None:
            stream.finish()

    for r, (lo, hi) in enumerate(ranges):
        agree(comm, tokenize, lo, hi)
        if exchange is not None:
            agree(comm, exchange.round, bufs, r == len(ranges) - 1)
    if bar is not None:
        bar.close()
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
        if report is not None:
            manifest["filter"] = {"min_chars": int(min_chars), "total": report["total"],
                                  "dropped": {r: report[r] for r in
                                              ("invalid", "empty", "short", "duplicate")}}
        if getattr(tok, "path", None):  # a trained BPE: saved beside the data, pinned by sha256
            dst = os.path.join(output, TOKENIZER_FILE)
            tmp = os.path.join(output, f"{TMP_PREFIX}{os.getpid()}-{TOKENIZER_FILE}")
            shutil.copyfile(tok.path, tmp)
            os.replace(tmp, dst)
            manifest["tokenizer"].update(file=TOKENIZER_FILE, sha256=tok.sha256)
        elif os.path.exists(os.path.join(output, TOKENIZER_FILE)):  # a previous dataset's
            os.unlink(os.path.join(output, TOKENIZER_FILE))
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
