"""Compressed pushes and pulls for sync.mode = "async_diloco" (sync.compression = bf16 | int8 | int4).

Without compression a replica applies its own arrival: it locks the servers' slices, reads
[theta | momentum | accumulator] and writes them back, 24 bytes per parameter, and a smaller
pseudo-gradient would not shorten that. With compression the server ranks apply the arrivals:

  replica  arrival number k from the shared counter -> Put its encoded pseudo-gradient slice (and
           the round's mean inner lr) into its own slot on every server of its part -> Flush ->
           publish k in the slot's header (an atomic REPLACE) -> ask for a pull at k -> wait
           until each server answered it -> Get the encoded change from the pull slot, add it
  server   while it waits in the meeting: a header holding `applied + 1` -> decode that slot ->
           apply the outer update to its own memory under an exclusive lock on itself -> applied += 1;
           a pull request at k <= applied from replica r -> encode d = theta - view[r] into r's
           pull slot, view[r] += decode(that) -> answered[r] = k

A pull moves the global model's change since the replica's last pull in the wire format, with
error feedback: the server keeps, per replica, the weights that replica holds (view[r]; both
sides add the same decoded bytes in fp32, so they stay bit-identical), and the quantization error
of one pull is sent with the next. A replica's weights are thus never further from the servers'
theta (at the time of the pull) than one rounding of d: half a step, block absmax(d) / 127 / 2 in
int8. A catch-up is a pull at the arrivals it saw. The views are the replicas' start points (the
replica checkpoints its start; `set_views` sends them to the servers at start and on resume).

A pull a replica can do without: its own arrival k, when its view holds exactly arrivals < k (it
pulled or caught up to k - 1) and arrival k's change of theta is its own pseudo-gradient alone
(`own_change`, given by async_diloco: outer SGD, or delayed Nesterov off its momentum arrivals):
theta - lr * decode(push) / R. Both sides then add that change to the view, in the same float32
operations on the same decoded bytes, so they stay bit-identical and the residual theta - view
(the error feedback) is unchanged; nothing is pulled from that server. Both sides know when: a
pull's answer word carries the arrival the view holds up to (`view_at`, per server); after a
resume it is unknown (-1) until the next pull; at start every view is the initial model (0). A
catch-up to arrivals a view already holds pulls nothing either. With `defer_momentum` (delayed
Nesterov, sync.defer_momentum_pull) an own arrival that also takes the momentum step is handled
the same way when no step is owed yet: both sides add the pseudo-gradient's share, the step stays
in theta - view (owed) and comes with the next pull, which clears the debt; so a view lacks at most
one momentum step beyond the error feedback's half quantization step. The pulls can be in a
coarser format than the pushes (`pull_kind`, sync.pull_compression): they carry error feedback,
the pushes only with `push_residual` (sync.error_feedback): the replica keeps what its encoded
push left out and adds it to its next push, so the sum of the pushes the servers applied stays
within one push's rounding of the sum of its pseudo-gradients (without it the roundings add up).

So an arrival moves the encoded push (2 bytes per parameter in bf16; 1 + 4 per int8 block of
sync.int8_block in int8; 1/2 + 4 per block in int4) and as much back, and the servers apply arrivals strictly in the order of
their numbers (every slice, every part of a tensor / pipeline parallel replica, sees one order).
A replica reads theta when its own arrival is in; arrivals after it may be in too (less staleness,
and the order stays the numbers' order). Encoding is DiLoCo's (hpctrain/sync/compress.py).

Owns: the inbox windows and this protocol; not the outer update's arithmetic (the caller's `apply`).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.plan.wire import encoded_bytes, wire_layout
from hpctrain.sync.compress import Codec

APPLIED = 0  # header word 0 on every server; then (arrival, lr_scale bits) per replica, then
# (pull asked at, pull answered at) per replica


class ArrivalInbox:
    """Collective over `comm` (one part of the model: its replica ranks, then its servers)."""

    def __init__(self, comm, servers: list[int], bounds: list[tuple[int, int]], n_replicas: int,
                 kind: str, block: int, pull_kind: str | None = None):
        self.comm, self.servers, self.bounds, self.kind = comm, servers, bounds, kind
        self.pull_kind, self.n_replicas = pull_kind or kind, n_replicas
        self.codecs, self.slot_bytes = _codecs(bounds, kind, block)  # pushes
        self.pull_codecs, self.pull_bytes = _codecs(bounds, self.pull_kind, block)
        me = servers.index(comm.rank) if comm.rank in servers else None
        self.me = me
        self.pull_words = 1 + 2 * n_replicas  # the first pull word
        words = 1 + 4 * n_replicas if me is not None else 0
        # pushes, then pulls, one slot per replica each
        slots = n_replicas * (self.slot_bytes[me] + self.pull_bytes[me]) if me is not None else 0
        self.header = MPI.Win.Allocate(8 * words, disp_unit=8, comm=comm)
        self.slots = MPI.Win.Allocate(slots, disp_unit=1, comm=comm)
        if me is not None:
            np.frombuffer(self.header.tomemory(), dtype=np.int64)[:] = 0
        self.next_arrival = 1
        self.answered = [0] * n_replicas  # server: the last pull answered, per replica
        self.views = None  # server: (n_replicas, slice) fp32, what each replica holds (set_views)
        self.view_at: list[int] = []  # the arrival each view holds up to (server: per replica;
        # replica: per server); -1 = unknown
        self.own_change = None  # (view slice, decoded g slice, arrival) -> applied? (module doc)
        self.defer_momentum = False  # an own arrival with a momentum step may skip its pull (doc)
        self.owed: list[bool] = []  # a skipped momentum step not pulled yet (per replica / server)
        self._posted: tuple[int, list[np.ndarray]] | None = None  # replica: its last push, decoded
        self.push_residual: np.ndarray | None = None  # replica: what its pushes' codes left out
        # (error feedback on pushes, sync.error_feedback; flat fp32 like its part; None: off)
        comm.Barrier()

    def set_views(self, replica: int, start: np.ndarray | None, held: int = -1) -> None:
        """Collective: every replica (comm rank = replica) sends its weights `start` (flat fp32,
        its part) to the servers, which keep them as its view. At start, where every view is the
        initial global model (`held` = 0 arrivals: the first arrival may be a replica's own
        change, pulled from nobody), and on resume (-1: unknown until the next pull)."""
        self.view_at = [held] * (self.n_replicas if self.me is not None else len(self.servers))
        self.owed = [False] * len(self.view_at)
        if self.me is None:
            self.comm.Barrier()
            for server, (lo, hi) in zip(self.servers, self.bounds):
                self.comm.Send(np.ascontiguousarray(start[lo:hi], dtype=np.float32), dest=server, tag=36)
            return
        lo, hi = self.bounds[self.me]
        self.views = np.empty((self.n_replicas, hi - lo), dtype=np.float32)
        self.comm.Barrier()
        for r in range(self.n_replicas):
            self.comm.Recv(self.views[r], source=r, tag=36)

    # ---- replica side ---------------------------------------------------------------------------
    def post(self, replica: int, arrival: int, g: np.ndarray, lr_scale: float, final: bool = False) -> int:
        """Put pseudo-gradient `g` (flat fp32, this rank's part) encoded into slot `replica` of
        every server, then publish `arrival`; bytes sent. `final` (the end of training's partial
        round) travels as the sign of the lr_scale word (lr_scale > 0). With push_residual, what
        the last push's codes left out is added to `g` first, and what this one's leave out kept."""
        sent, decoded, residual = 0, [], self.push_residual
        if residual is not None:
            g = g + residual
        for s, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds)):
            codec = self.codecs[s]
            padded = torch.zeros(codec.chunk, dtype=torch.float32)
            padded[:hi - lo] = torch.from_numpy(g[lo:hi])
            payload = torch.cat(codec.encode(padded)).numpy()
            if self.own_change is not None or residual is not None:  # what the server will decode, bit for bit
                decoded.append(codec.decode(codec.split(torch.from_numpy(payload)))[:hi - lo].numpy())
            if residual is not None:
                residual[lo:hi] = g[lo:hi] - decoded[-1]
            scale = -lr_scale if final else lr_scale
            words = np.array([arrival, np.float64(scale).view(np.int64)], dtype=np.int64)
            self.slots.Lock(server, MPI.LOCK_SHARED)
            self.slots.Put([payload, MPI.BYTE], server, target=(replica * self.slot_bytes[s], payload.size, MPI.BYTE))
            self.slots.Unlock(server)  # the payload is in the server's memory before the header says so
            self.header.Lock(server, MPI.LOCK_SHARED)
            self.header.Accumulate([words[1:], MPI.INT64_T], server, target=(2 + 2 * replica, 1, MPI.INT64_T),
                                   op=MPI.REPLACE)
            self.header.Flush(server)
            self.header.Accumulate([words[:1], MPI.INT64_T], server, target=(1 + 2 * replica, 1, MPI.INT64_T),
                                   op=MPI.REPLACE)
            self.header.Unlock(server)
            sent += payload.size + 16
        self._posted = (arrival, decoded)
        return sent

    def pull(self, replica: int, at: int, start: np.ndarray) -> tuple[np.ndarray, int]:
        """Ask every server for the change since my last pull once arrival `at` is applied;
        (start + the decoded changes: my new weights, as the servers' view of them; bytes moved).
        With own_change, a server whose view of me holds arrival `at` already, or exactly the
        arrivals before my own arrival `at` (module docstring), is not asked."""
        theta, ask = start.copy(), self._servers_to_ask(at, start)
        word = np.array([at], dtype=np.int64)
        for s in ask:
            self.header.Lock(self.servers[s], MPI.LOCK_SHARED)
            self.header.Accumulate([word, MPI.INT64_T], self.servers[s],
                                   target=(self.pull_words + 2 * replica, 1, MPI.INT64_T), op=MPI.REPLACE)
            self.header.Unlock(self.servers[s])
        moved = 0
        for s in ask:
            server, (lo, hi) = self.servers[s], self.bounds[s]
            self.view_at[s] = self._wait_word(server, self.pull_words + 2 * replica + 1, at)
            size = self.pull_bytes[s]
            raw = np.empty(size, dtype=np.uint8)
            self.slots.Lock(server, MPI.LOCK_SHARED)
            self.slots.Get([raw, MPI.BYTE], server, target=(self._pull_slot(s, replica), size, MPI.BYTE))
            self.slots.Unlock(server)
            codec = self.pull_codecs[s]
            theta[lo:hi] = start[lo:hi] + codec.decode(codec.split(torch.from_numpy(raw)))[:hi - lo].numpy()
            moved += size + 16
            self.owed[s] = False
        for s in sorted(set(range(len(self.servers))) - set(ask)):  # no pull: my own change, or none
            lo, hi = self.bounds[s]
            if self.view_at[s] < at:
                self.owed[s] |= not self.own_change.applies(at)
                self.own_change(theta[lo:hi], self._posted[1][s], at)
                self.view_at[s] = at
            # as after a pull, go on once `at` is applied there (a checkpoint then finds it in)
            self._wait_word(self.servers[s], APPLIED, at)
        return theta, moved

    def _pull_slot(self, s: int, replica: int) -> int:
        """Byte offset of `replica`'s pull slot on server index `s` (after the push slots)."""
        return self.n_replicas * self.slot_bytes[s] + replica * self.pull_bytes[s]

    def _servers_to_ask(self, at: int, start: np.ndarray) -> list[int]:
        """The servers a pull at `at` must ask (all of them without own_change)."""
        if self.own_change is None:
            return list(range(len(self.servers)))
        mine = self._posted is not None and self._posted[0] == at
        return [s for s, held in enumerate(self.view_at)
                if not (held >= at or (mine and held == at - 1 and self._own(at, self.owed[s])))]

    def _own(self, arrival: int, owed: bool) -> bool:
        """Does a replica whose view holds the arrivals before its own `arrival` add that
        arrival's change itself (no pull)? Its pseudo-gradient alone; with defer_momentum also
        one that takes the momentum step, when no earlier step is owed (the step then comes with
        the next pull; the same rule on both sides)."""
        return self.own_change.applies(arrival) or (self.defer_momentum and not owed)

    def _wait_word(self, server: int, index: int, at_least: int, poll_s: float = 0.0002) -> int:
        """Until word `index` on `server` is >= at_least; its value."""
        word, out = np.zeros(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        while True:
            self.header.Lock(server, MPI.LOCK_SHARED)
            self.header.Fetch_and_op([word, MPI.INT64_T], [out, MPI.INT64_T], server, index, MPI.NO_OP)
            self.header.Unlock(server)
            if out[0] >= at_least:
                return int(out[0])
            time.sleep(poll_s)

    def wait_applied(self, arrival: int, poll_s: float = 0.0002) -> None:
        """Until every server has applied arrival number `arrival`."""
        for server in self.servers:
            self._wait_word(server, APPLIED, arrival, poll_s)

    # ---- server side ----------------------------------------------------------------------------
    def _read_header(self) -> np.ndarray:
        out = np.empty(1 + 4 * self.n_replicas, dtype=np.int64)
        me = self.comm.rank
        self.header.Lock(me, MPI.LOCK_SHARED)
        self.header.Get_accumulate([np.empty_like(out), MPI.INT64_T], [out, MPI.INT64_T], me,
                                   target=(0, out.size, MPI.INT64_T), op=MPI.NO_OP)
        self.header.Unlock(me)
        return out

    def serve(self, apply, theta) -> int:
        """Server: apply every posted arrival that is next in order, answer the pulls asked at an
        applied arrival; how many arrivals were applied. `apply(g_slice, arrival, lr_scale, final)`
        updates this server's memory (the caller locks it); `theta()` a copy of its theta slice."""
        done = 0
        while True:
            header = self._read_header()
            self._answer_pulls(header, theta)
            posted = header[1:self.pull_words:2]
            ready = np.nonzero(posted == self.next_arrival)[0]
            if ready.size == 0:
                return done
            replica = int(ready[0])
            lr_scale = float(header[2 + 2 * replica:3 + 2 * replica].view(np.float64)[0])
            g = self._decode(replica)
            apply(g, self.next_arrival, abs(lr_scale), lr_scale < 0)  # < 0: final (post)
            self._follow_own_change(replica, g)
            me, word = self.comm.rank, np.array([self.next_arrival], dtype=np.int64)
            self.header.Lock(me, MPI.LOCK_SHARED)
            self.header.Accumulate([word, MPI.INT64_T], me, target=(APPLIED, 1, MPI.INT64_T), op=MPI.REPLACE)
            self.header.Unlock(me)
            self.next_arrival += 1
            done += 1

    def _follow_own_change(self, replica: int, g: np.ndarray) -> None:
        """After applying the replica's arrival: the change it adds without a pull, added to its
        view too (the same rule as _servers_to_ask, on the same decoded bytes)."""
        k = self.next_arrival
        if self.own_change is not None and self.view_at[replica] == k - 1 and self._own(k, self.owed[replica]):
            self.owed[replica] |= not self.own_change.applies(k)
            self.own_change(self.views[replica], g, k)
            self.view_at[replica] = k

    def _answer_pulls(self, header: np.ndarray, theta) -> None:
        asked = header[self.pull_words::2]
        for r in np.nonzero((asked > np.array(self.answered)) & (asked < self.next_arrival))[0]:
            codec, size, me = self.pull_codecs[self.me], self.pull_bytes[self.me], self.comm.rank
            view = self.views[r]
            padded = torch.zeros(codec.chunk, dtype=torch.float32)
            padded[:view.size] = torch.from_numpy(theta() - view)
            parts = codec.encode(padded)
            view += codec.decode(parts)[:view.size].numpy()  # what the replica adds: error feedback
            payload = torch.cat(parts).numpy()
            self.slots.Lock(me, MPI.LOCK_EXCLUSIVE)
            self.slots.Put([payload, MPI.BYTE], me, target=(self._pull_slot(self.me, r), size, MPI.BYTE))
            self.slots.Unlock(me)
            self.answered[r] = int(asked[r])
            self.owed[r] = False
            self.view_at[r] = self.next_arrival - 1  # theta() holds every arrival applied
            word = np.array([self.view_at[r]], dtype=np.int64)  # >= asked: the replica learns it
            self.header.Lock(me, MPI.LOCK_SHARED)
            self.header.Accumulate([word, MPI.INT64_T], me, target=(self.pull_words + 2 * r + 1, 1, MPI.INT64_T),
                                   op=MPI.REPLACE)
            self.header.Unlock(me)

    def _decode(self, replica: int) -> np.ndarray:
        codec, size, me = self.codecs[self.me], self.slot_bytes[self.me], self.comm.rank
        raw = np.empty(size, dtype=np.uint8)
        self.slots.Lock(me, MPI.LOCK_SHARED)
        self.slots.Get([raw, MPI.BYTE], me, target=(replica * size, size, MPI.BYTE))
        self.slots.Unlock(me)
        lo, hi = self.bounds[self.me]
        return codec.decode(codec.split(torch.from_numpy(raw)))[:hi - lo].numpy()

    def restart_at(self, arrivals: int) -> None:
        """Server, on resume (nobody posts meanwhile): `arrivals` are in the restored model."""
        if self.me is not None:
            header = np.frombuffer(self.header.tomemory(), dtype=np.int64)
            header[:] = 0
            header[APPLIED] = arrivals
        self.next_arrival = arrivals + 1
        self.answered = [0] * self.n_replicas

    def free(self) -> None:
        self.header.Free()
        self.slots.Free()


def _codecs(bounds: list[tuple[int, int]], kind: str, block: int) -> tuple[list[Codec], list[int]]:
    """One codec per server's slice in wire format `kind`, and its encoded size in bytes."""
    codecs, sizes = [], []
    for lo, hi in bounds:
        chunk, blk = wire_layout(hi - lo, 1, kind, block)
        codecs.append(Codec(kind, chunk, blk))
        sizes.append(encoded_bytes(chunk, kind, blk))
    return codecs, sizes
