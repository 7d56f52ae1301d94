"""How `shard` splits work between MPI ranks and gathers each shard at its owner.

Owns: cutting documents into rounds (memory bound) and each round into chunks; handing chunks
to ranks dynamically (a shared counter per round, MPI one-sided fetch-and-add, claimed one chunk
ahead), so a slow core, a slow node or a slow stretch of text does not hold the others back;
and the per-round exchange that moves every chunk's slice of every shard to the shard's owner.

Must never: let the output bytes depend on who tokenized which chunk (global token offsets
come from the chunk ORDER, never from the claim order), post sends and receives between a pair
of ranks in different orders (MPI's non-overtaking rule is what matches them), or let one rank
hold more than ~2 ranks' fair share of a round's text.
"""
from __future__ import annotations

import numpy as np

from .documents import balanced_ranges
from .format import SPLITS

CHUNKS_PER_RANK = 64  # per round: the last chunk bounds the idle tail at its end (~1/64 of it)
_TAG_TOKENS, _TAG_DOCS = 11, 12


def starts_in(starts: np.ndarray, a: int, b: int) -> np.ndarray:
    """The (sorted) document starts that fall in [a, b)."""
    return starts[np.searchsorted(starts, a, "left"):np.searchsorted(starts, b, "left")]


def round_cuts(length: np.ndarray, per_round: int) -> list[tuple[int, int]]:
    """Cut documents into consecutive rounds of about ``per_round`` bytes of text (document i
    joins round floor(bytes before i / per_round)).  Only bounds memory; never changes output."""
    before = np.cumsum(length, dtype=np.int64) - length
    rnd = before // max(1, int(per_round))
    cuts = [0] + (np.flatnonzero(np.diff(rnd)) + 1).tolist() + [int(length.size)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def round_chunks(length: np.ndarray, a: int, b: int, size: int) -> list[tuple[int, int]]:
    """Documents [a, b) cut into up to ``size * CHUNKS_PER_RANK`` non-empty, byte-balanced,
    contiguous chunks (absolute document indices)."""
    n = max(1, min(b - a, size * CHUNKS_PER_RANK))
    return [(a + lo, a + hi) for lo, hi in balanced_ranges(length[a:b], n) if hi > lo]


class ChunkQueue:
    """Dynamic chunk hand-out: one int64 counter per round in a window on rank 0; a claim is an
    atomic fetch-and-add (MPI_Rget_accumulate), issued one chunk ahead so its latency hides
    behind tokenizing.  Collective to create and to ``close``."""

    def __init__(self, comm, n_rounds: int):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.win = MPI.Win.Allocate(8 * n_rounds if comm.Get_rank() == 0 else 0, 8, comm=comm)
        if comm.Get_rank() == 0:
            self.win.Lock(0, MPI.LOCK_EXCLUSIVE)
            self.win.Put(np.zeros(n_rounds, np.int64), 0, target=(0, n_rounds, MPI.INT64_T))
            self.win.Unlock(0)
        comm.Barrier()
        self.win.Lock_all()

    def claims(self, rnd: int, sizes: list[int], cap: int):
        """Yield the chunk indices of round ``rnd`` this rank gets, in increasing order; stop
        claiming once this rank holds ``cap`` bytes (every chunk is still taken by someone:
        ranks stop only after claiming >= cap each, and cap * ranks > the round's bytes)."""
        one, held = np.ones(1, np.int64), 0

        def claim():
            got = np.empty(1, np.int64)
            i64 = self.MPI.INT64_T  # explicit on both sides: Open MPI rejects LONG vs INT64_T
            req = self.win.Rget_accumulate([one, i64], [got, i64], 0, target=(rnd, 1, i64),
                                           op=self.MPI.SUM)
            return req, got

        pending = claim()
        try:
            while pending is not None:
                pending[0].Wait()
                c = int(pending[1][0])
                pending = None
                if c >= len(sizes):
                    return
                held += sizes[c]
                if held < cap:
                    pending = claim()  # the next one travels while this one is tokenized
                yield c
        finally:
            if pending is not None:  # an error while tokenizing: complete the claim in flight
                pending[0].Wait()

    def close(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


class RoundExchange:
    """After each round, every rank sends its chunks' slices of every shard the round touches
    to the shard's owner (train shard k -> rank k % size, val shard k -> rank (k + size // 2) %
    size); an owner keeps a shard's buffer only until it is full, then hands it to ``emit``.
    Between a pair of ranks, a round sends one token and one doc-offset message per shard, posted
    and received in the same (split, shard) order (the round ends with Waitall), so MPI's
    non-overtaking rule matches them without per-shard tags."""

    def __init__(self, comm, emit, shard_tokens, dtype):
        self.comm, self.emit, self.S, self.dtype = comm, emit, shard_tokens, dtype
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.base = np.zeros(len(SPLITS), np.int64)  # tokens of each split before this round
        self.open = {}  # (split, k) -> [buffer, [doc offset arrays], tokens filled]

    def owner(self, si: int, k: int) -> int:
        return (k + si * (self.size // 2)) % self.size

    def round(self, held: dict, n_chunks: int, final: bool) -> None:
        """``held``: chunk index -> {split: (tokens, doc starts local to the chunk's tokens)}
        for the chunks of this round this rank tokenized."""
        from mpi4py import MPI

        holder, layout = self._gather_layout(held, n_chunks)
        types = []  # committed MPI datatypes, freed once every request completed
        requests = self._post_sends(layout, types)
        first_err = self._receive_owned(layout, holder, n_chunks, types)
        if final:  # the short last shard of each split
            for s, k in sorted(self.open):
                first_err = self._write(s, k, first_err)
        MPI.Request.Waitall(requests)
        for t in types:
            t.Free()
        self.base = layout.starts[-1].copy()
        if first_err is not None:
            raise first_err

    def _gather_layout(self, held: dict, n_chunks: int):
        """Allgather every chunk's token count per split and its holder rank; return (holder,
        the round's _RoundLayout)."""
        mine = sorted(held)
        counts = np.zeros((n_chunks, len(SPLITS)), np.int64)
        holder = np.full(n_chunks, -1)
        for r, lst in enumerate(self.comm.allgather([(c, [held[c][s][0].size for s in SPLITS])
                                                     for c in mine])):
            for c, cnt in lst:
                counts[c], holder[c] = cnt, r
        assert (holder >= 0).all(), "a chunk of the round was claimed by no rank"
        starts = self.base + np.vstack([np.zeros((1, len(SPLITS)), np.int64),
                                        np.cumsum(counts, axis=0)])  # global, per chunk
        local = {c: {s: (held[c][s][0], held[c][s][1] + starts[c, si])
                     for si, s in enumerate(SPLITS)} for c in mine}
        return holder, _RoundLayout(starts, local, self.S)

    def _post_sends(self, layout: "_RoundLayout", types: list) -> list:
        """Post this rank's pieces of every shard another rank owns; return the requests.
        One token message and one doc-offset message per (peer, shard): a rank's pieces of a
        shard go out in chunk order as one message (an hindexed MPI datatype over the pieces
        where they lie) and land straight in the owner's buffer (an indexed datatype built
        from the allgathered counts)."""
        from mpi4py import MPI
        from mpi4py.util.dtlib import from_numpy_dtype

        comm, S, requests = self.comm, self.S, []
        for si, s, k in layout.plan():
            dest = self.owner(si, k)
            if dest == self.rank:
                continue
            spans = [(c, *layout.piece(c, si, k)) for c in sorted(layout.local)]
            parts = [layout.part(c, s, si, a, b) for c, a, b in spans if a < b]
            if len(parts) == 1:
                requests.append(comm.Isend(parts[0][0], dest=dest, tag=_TAG_TOKENS))
            elif parts:  # the pieces in place (absolute addresses from MPI_BOTTOM): no send copy
                mpi_type = from_numpy_dtype(self.dtype).Create_hindexed(
                    [t.size for t, _ in parts], [MPI.Get_address(t) for t, _ in parts]).Commit()
                types.append(mpi_type)
                requests.append(comm.Isend([MPI.BOTTOM, 1, mpi_type], dest=dest, tag=_TAG_TOKENS))
            if parts:
                requests.append(comm.isend(np.concatenate([d for _, d in parts]) - k * S, dest=dest,
                                           tag=_TAG_DOCS))
        return requests

    def _receive_owned(self, layout: "_RoundLayout", holder, n_chunks: int, types: list):
        """Fill the buffers of the shards this rank owns (own pieces copied, the others'
        received in rank order); emit each one that is full.  Returns the first emit error."""
        first_err = None
        for si, s, k in layout.plan():
            if self.owner(si, k) != self.rank:
                continue
            slot = self.open.setdefault((s, k), [np.empty(self.S, dtype=self.dtype), [], 0])
            by_rank = {}
            for c in range(n_chunks):
                a, b = layout.piece(c, si, k)
                if a < b:
                    by_rank.setdefault(int(holder[c]), []).append((c, a, b))
                    slot[2] += b - a
            for c, a, b in by_rank.pop(self.rank, []):
                toks, docs = layout.part(c, s, si, a, b)
                slot[0][a - k * self.S:b - k * self.S] = toks
                slot[1].append(docs - k * self.S)
            for src in sorted(by_rank):
                self._receive_from(src, by_rank[src], slot, k * self.S, types)
            if slot[2] == self.S:
                first_err = self._write(s, k, first_err)
        return first_err

    def _receive_from(self, src: int, spans: list, slot: list, lo: int, types: list) -> None:
        """Rank ``src``'s token message (its ``spans`` [a, b) of the shard starting at global
        offset ``lo``, straight into the buffer) and its doc-offset message."""
        from mpi4py.util.dtlib import from_numpy_dtype

        out = slot[0]
        if len(spans) == 1:
            _, a, b = spans[0]
            self.comm.Recv(out[a - lo:b - lo], source=src, tag=_TAG_TOKENS)
        else:
            mpi_type = from_numpy_dtype(out.dtype).Create_indexed(
                [b - a for _, a, b in spans], [a - lo for _, a, b in spans]).Commit()
            types.append(mpi_type)
            self.comm.Recv([out, 1, mpi_type], source=src, tag=_TAG_TOKENS)
        slot[1].append(self.comm.recv(source=src, tag=_TAG_DOCS))

    def _write(self, s, k, first_err):
        out, offs, n = self.open.pop((s, k))
        if first_err is None:  # after a failure keep receiving (senders must complete)
            try:
                # pieces arrive by rank, not in chunk order; offsets are unique, so sort them
                self.emit(s, k, out[:n], np.sort(np.concatenate(offs)) if offs else np.zeros(0, np.int64))
            except Exception as exc:  # noqa: BLE001 - re-raised after the exchange
                return exc
        return first_err


class _RoundLayout:
    """One round's geometry: ``starts[c, si]`` = global offset of chunk c's first token of split
    si (row n_chunks = the round's end); ``local`` = this rank's chunks, doc starts made global."""

    def __init__(self, starts: np.ndarray, local: dict, shard_tokens: int):
        self.starts, self.local, self.S = starts, local, shard_tokens

    def plan(self) -> list[tuple[int, str, int]]:
        """(split index, split, shard k) of every shard the round touches, in the order every
        rank posts and receives them."""
        st, S = self.starts, self.S
        return [(si, s, k) for si, s in enumerate(SPLITS) if st[-1, si] > st[0, si]
                for k in range(int(st[0, si]) // S, (int(st[-1, si]) - 1) // S + 1)]

    def piece(self, c: int, si: int, k: int) -> tuple[int, int]:
        """[a, b) of shard k of split si in chunk c, global offsets (empty: a >= b)."""
        return (max(k * self.S, int(self.starts[c, si])),
                min((k + 1) * self.S, int(self.starts[c + 1, si])))

    def part(self, c: int, s: str, si: int, a: int, b: int):
        """Chunk c's tokens [a, b) of split s and its documents starting there (global)."""
        toks, gdocs = self.local[c][s]
        g0 = int(self.starts[c, si])
        return toks[a - g0:b - g0], starts_in(gdocs, a, b)
