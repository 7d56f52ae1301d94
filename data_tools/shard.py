"""``shard``: turn text/JSONL inputs into an hpctrain dataset (HDF5 shards + manifest.json).

Owns: the shard pipeline — output-dir safety (one writer per --output: output_lock.py; built
beside --output, swapped in at the end: staging.py), planning (rank 0 enumerates documents and
assigns splits), tokenizing (1 rank: streaming; MPI: round by round, so memory stays bounded,
each round's chunks handed out dynamically and gathered at the shard owners — see exchange.py),
cutting each split's token stream into shards, and writing the manifest LAST.

Must never: let the output bytes depend on the number of ranks (tests run 1, 2 and 3 ranks and
compare bytes), touch the output dir before the new dataset is complete, write the manifest
before every shard is durable, or raise on one rank only (see mpiutil.agree).
"""
from __future__ import annotations

import os
import shutil
import sys
import time

import numpy as np

from . import documents, staging
from .format import (CHAT_FORMAT_VERSION, FORMAT_CHAT, FORMAT_PREFERENCE, FORMAT_VERSION, SPLITS, TMP_PREFIX, DataError, fsync_path, shard_filename,
                     token_dtype, write_manifest, write_shard)
from .chat import ChatError
from .exchange import ChunkQueue, RoundExchange, round_chunks, round_cuts, starts_in
from .mpiutil import SerialComm, agree, root_then_bcast, threads_per_rank
from .output_lock import OutputLock
from .tokenizers import get_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 1234
BATCH_BYTES = 8 << 20  # text handed to the tokenizer per call
BATCH_DOCS = 512
TOKENIZER_FILE = "tokenizer.json"  # a tokenizer.json, copied beside the shards
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # copied too when it sits beside it
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' separate template file: copied too
FORMATS = ("text", FORMAT_CHAT, FORMAT_PREFERENCE)
ROUND_BYTES = 64 << 20  # MPI: text each rank tokenizes per round (bounds memory, see docs/data.md)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10  # bytes on macOS, else KiB


def _plan(inputs, out, val_fraction, seed, extensions, text_column, chat):
    """Rank 0: refuse a bad --output before any work, list the documents, then open the staging
    folder beside --output (nothing at --output changes until the final swap)."""
    staging.check_output(out, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE)
    table = documents.enumerate_documents(inputs, extensions=extensions, text_column=text_column)
    if chat:  # the format's name: how a JSONL line becomes a document (documents.py)
        table.chat = chat
        for path, is_jsonl in zip(table.files, table.jsonl):
            if not is_jsonl:
                raise DataError(path, f"--format {chat} reads .jsonl files only (docs/data.md)")
    is_val = documents.assign_val(len(table), val_fraction, seed)
    staging.begin(out)
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
        # one piece (a document larger than a shard) is used as it is: no second copy of it
        toks = (self.pieces[0] if len(self.pieces) == 1 else np.concatenate(self.pieces)
                if self.pieces else np.zeros(0, dtype))
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
            offs = starts_in(starts, pos, end) - pos
            self.emit(split, self.next_k[split], toks[pos:end], offs)
            self.next_k[split] += 1
            pos = end
        if pos < toks.size:  # keep the partial shard, starts re-based to it
            b = self.buf[split]
            b.pieces, b.n = [toks[pos:]], toks.size - pos
            b.starts = (starts_in(starts, pos, toks.size) - pos).tolist()

    def finish(self):
        for s in SPLITS:
            self._flush(s, final=True)


def _tokenize_rounds(comm, table, rounds, tokenize, exchange, round_bytes, dtype, bar):
    """MPI: each round's chunks go to whichever rank asks next (ChunkQueue); then the round's
    tokens move to the shard owners (RoundExchange).  A rank holds at most ~2 x round_bytes of
    a round's text, whatever the others do."""
    size, cum = comm.Get_size(), np.concatenate([[0], np.cumsum(table.length, dtype=np.int64)])
    queue = ChunkQueue(comm, len(rounds))
    try:
        for r, (a, b) in enumerate(rounds):
            chunks = round_chunks(table.length, a, b, size)
            nbytes = [int(cum[hi] - cum[lo]) for lo, hi in chunks]
            held = {}

            def work():
                claims = queue.claims(r, nbytes, cap=2 * round_bytes + max(nbytes))
                try:
                    for c in claims:
                        if bar is not None:  # rank 0 shows the whole job: text handed out so far
                            bar.update(int(cum[chunks[c][0]]) - bar.n)
                        bufs = {s: _Buffer() for s in SPLITS}
                        tokenize(*chunks[c], lambda split, doc: bufs[split].add(doc))
                        held[c] = {s: bufs[s].take(dtype) for s in SPLITS}
                finally:
                    claims.close()  # completes a claim still in flight before the epoch ends

            agree(comm, work)
            agree(comm, exchange.round, held, len(chunks), r == len(rounds) - 1)
            if bar is not None:
                bar.update(int(cum[b]) - bar.n)
    finally:
        queue.close()


def shard_dataset(inputs, output, tokenizer="gpt2", shard_tokens=DEFAULT_SHARD_TOKENS,
                  val_fraction=DEFAULT_VAL_FRACTION, seed=DEFAULT_SEED, comm=None,
                  progress=True, log=None, round_bytes=ROUND_BYTES, filter=False,
                  min_chars=1, eot_token=None, eot_id=None, extensions=None,
                  text_column="text", format="text") -> dict:
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
                            (not 0 <= int(seed) < 2 ** 63, "--seed", f"must be in [0, 2**63), got {seed}"),
                            (format not in FORMATS, "--format", f"must be one of {FORMATS}, got {format!r}"),
                            (format != "text" and filter, "--filter",
                             f"is for text documents, not --format {format}")):
        if bad:
            err = DataError(where, why)
            err.collective = True  # every rank checks the same arguments and fails identically
            raise err
    shard_tokens, val_fraction, seed = int(shard_tokens), float(val_fraction), int(seed)
    tok = agree(comm, lambda: _tokenizer(tokenizer, eot_token, eot_id, format))
    import h5py  # noqa: F401 - the shard writer's library: loaded in setup, not at the first write
    dtype = token_dtype(tok.vocab_size)
    held = []  # rank 0: the output's lock, held until the dataset is swapped in or abandoned

    def lock_and_plan():
        held.append(OutputLock(output).acquire())
        return _plan(inputs, output, val_fraction, seed, extensions, text_column,
                     format if format != "text" else "")

    stage, planned = staging.staging_dir(output), False
    try:
        try:
            table, is_val = root_then_bcast(comm, lock_and_plan)
            planned = True
            manifest, gathered, t_plan = _build(comm, tok, dtype, table, is_val, stage, output,
                                                shard_tokens, val_fraction, seed, progress, log,
                                                round_bytes, filter, min_chars)
        except BaseException:
            if planned or held:  # the staging folder is ours (a Ctrl-C may come right after
                staging.abandon(stage)  # the plan made it); the destination was never touched
            raise
    finally:
        for lock in held:
            lock.release()
    if rank == 0:
        _summary(log, manifest, gathered, output, tok, dtype, size, t0, t_plan)
    return manifest


def _build(comm, tok, dtype, table, is_val, output, final, shard_tokens, val_fraction, seed,
           progress, log, round_bytes, filter, min_chars):
    """Tokenize into the staging folder ``output``, write its manifest, swap it in at ``final``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    report = None
    if filter:  # drop bad/short/duplicate documents, then number and split the kept ones
        table, is_val, report = _filter_table(comm, table, val_fraction, seed, min_chars, log)
    t_plan = time.perf_counter()
    # Rounds of ~ROUND_BYTES of text per rank bound memory (MPI); 1 rank streams in one round.
    rounds = round_cuts(table.length, round_bytes * size) if size > 1 else [(0, len(table))]
    threads = threads_per_rank(comm)
    entries = []
    packed = getattr(tok, "packs_loss_mask", False)  # chat: id | mask << 32 until written
    token_dtype_ = dtype
    dtype = np.dtype(np.uint64) if packed else dtype

    def emit(split, k, toks, offs):
        path = os.path.join(output, shard_filename(split, k))
        mask = None
        if packed:
            from .chat import unpack

            toks, mask = unpack(toks, token_dtype_)
        entries.append(write_shard(path, toks, offs, split=split, tokenizer=tok.name,
                                   vocab_size=tok.vocab_size, eot_id=tok.eot_id, loss_mask=mask))

    bar = _progress_bar(table, size) if rank == 0 and progress else None
    tokenize = _document_tokenizer(tok, dtype, table, is_val, threads,
                                   bar if size == 1 else None)
    if size == 1:
        stream = _StreamWriter(emit, shard_tokens, dtype)
        tokenize(0, len(table), stream.add)
        stream.finish()
    else:
        _tokenize_rounds(comm, table, rounds, tokenize, RoundExchange(comm, emit, shard_tokens, dtype),
                         round_bytes, dtype, bar)
    if bar is not None:
        bar.close()
    gathered = comm.gather((entries, peak_rss_mb()), root=0)

    def finish():
        if rank != 0:
            return None
        manifest = _manifest(tok, token_dtype_, seed, val_fraction, shard_tokens, is_val,
                             _sorted_shards(gathered), report, min_chars)
        if getattr(tok, "path", None):  # a tokenizer.json: saved beside the data, pinned by sha256
            _copy_tokenizer_files(tok, output)
            manifest["tokenizer"].update(file=TOKENIZER_FILE, sha256=tok.sha256)
        fsync_path(output)  # the shard renames are durable before the manifest appears
        write_manifest(output, manifest)
        staging.commit(output, final)
        return manifest

    return comm.bcast(agree(comm, finish), root=0), gathered, t_plan


def _filter_table(comm, table, val_fraction, seed, min_chars, log):
    """--filter: the kept documents' table, their fresh train/val split and the filter report."""
    from .validate import describe_report, filter_documents, subset

    keep, report = filter_documents(table, min_chars, comm)
    table = subset(table, keep)
    is_val = documents.assign_val(len(table), val_fraction, seed)
    if comm.Get_rank() == 0:
        log("filter: " + describe_report(report, min_chars))
    return table, is_val, report


def _progress_bar(table, size):
    """Rank 0's tqdm bar on stderr over the text's bytes."""
    from tqdm import tqdm

    return tqdm(total=int(table.length.sum()), unit="B", unit_scale=True, file=sys.stderr,
                disable=None, desc=f"tokenize ({size} rank{'s' if size > 1 else ''})")


def _document_tokenizer(tok, dtype, table, is_val, threads, bar):
    """tokenize(lo, hi, add): documents [lo, hi) in order, add(split, tokens + end-of-text) for
    each, in batches of BATCH_BYTES / BATCH_DOCS; ``bar`` (1 rank only) advances per document."""
    largest_id = getattr(tok, "largest_id", lambda ids: int(ids.max()) if ids.size else -1)

    def run(batch, add):
        docs, texts = [i for i, _ in batch], [t for _, t in batch]
        batch.clear()  # each text goes once it is tokenized, each token list once it is cast
        try:
            try:
                arrs = tok.encode_batch(texts, num_threads=threads)
            except ChatError as e:  # --format chat: a conversation it cannot shard
                raise DataError(documents.where(table, docs[e.index]), e.problem) from None
            del texts
            for j, i in enumerate(docs):
                ids, arrs[j] = arrs[j], None
                top = largest_id(ids)
                if top >= tok.vocab_size:  # never a silent wrap to uint16
                    raise DataError(documents.where(table, i), f"token id {top} >= "
                                    f"the vocabulary size {tok.vocab_size} of {tok.name}")
                doc = np.empty(ids.size + 1, dtype)  # one copy: ids cast in place, then end-of-text
                doc[:-1] = ids
                doc[-1] = tok.eot_id
                del ids
                add("val" if is_val[i] else "train", doc)
                if bar is not None:
                    bar.update(int(table.length[i]))
        except MemoryError:
            largest = max(docs, key=lambda d: int(table.length[d]))
            raise DataError(documents.where(table, largest), f"out of memory tokenizing it "
                            f"({int(table.length[largest]) / 2 ** 20:,.0f} MiB of text): give the "
                            f"process more memory (docs/data.md: memory bound)") from None

    def tokenize(lo, hi, add):
        batch, nbytes = [], 0
        for i, text in documents.iter_texts(table, lo, hi):
            batch.append((i, text))
            nbytes += len(text)
            del text  # the batch holds the only reference: run() lets it go when tokenized
            if nbytes >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                run(batch, add)
                nbytes = 0
        run(batch, add)

    return tokenize


def _tokenizer(name, eot_token, eot_id, format):
    """The tokenizer --tokenizer names; for --format chat wrapped to render conversations."""
    tok = get_tokenizer(name, eot_token=eot_token, eot_id=eot_id)
    if format == "text":
        return tok
    from .chat import ChatTokenizer
    from .preference import PreferenceTokenizer

    return (PreferenceTokenizer if format == FORMAT_PREFERENCE else ChatTokenizer)(tok)


def _sorted_shards(gathered) -> list[dict]:
    """Every rank's shard entries, train before val, by file name."""
    order = {s: i for i, s in enumerate(SPLITS)}
    return sorted((e for part, _ in gathered for e in part),
                  key=lambda e: (order[e["split"]], e["file"]))


def _manifest(tok, dtype, seed, val_fraction, shard_tokens, is_val, shards, report, min_chars):
    """manifest.json's content (before the tokenizer file's name and sha256 are added)."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
        "dtype": dtype.name, "seed": seed, "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "n_documents": {"train": int((~is_val).sum()), "val": int(is_val.sum())},
        "n_tokens": {s: sum(e["n_tokens"] for e in shards if e["split"] == s) for s in SPLITS},
        "shards": shards,
    }
    if getattr(tok, "packs_loss_mask", False):
        from .preference import PreferenceTokenizer

        manifest.update(format_version=CHAT_FORMAT_VERSION, format=FORMAT_PREFERENCE
                        if isinstance(tok, PreferenceTokenizer) else FORMAT_CHAT)
    if report is not None:
        manifest["filter"] = {"min_chars": int(min_chars), "total": report["total"],
                              "dropped": {r: report[r] for r in
                                          ("invalid", "empty", "short", "duplicate")}}
    return manifest


def _copy_tokenizer_files(tok, output) -> None:
    """tokenizer.json and, when it sits beside it, tokenizer_config.json into the dataset."""
    folder = os.path.dirname(os.path.abspath(tok.path))
    for src, name in ((tok.path, TOKENIZER_FILE),
                      (os.path.join(folder, TOKENIZER_CONFIG_FILE), TOKENIZER_CONFIG_FILE),
                      (os.path.join(folder, CHAT_TEMPLATE_FILE), CHAT_TEMPLATE_FILE)):
        if name == TOKENIZER_FILE or os.path.isfile(src):
            tmp = os.path.join(output, f"{TMP_PREFIX}{os.getpid()}-{name}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(output, name))


def _summary(log, manifest, gathered, output, tok, dtype, size, t0, t_plan):
    """The closing lines on rank 0: counts, throughput, peak memory."""
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
        f"{dw:.2f} s = {total / max(dw, 1e-9):,.0f} tokens/s\n"
        f"  peak memory {max(mb for _, mb in gathered):,.0f} MB (max RSS over ranks; see docs/data.md "
        f"for the bound)")
