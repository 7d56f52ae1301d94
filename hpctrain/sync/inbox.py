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

So an arrival moves the encoded push (2 bytes per parameter in bf16; 1 + 4 per int8 block of
sync.int8_block in int8; 1/2 + 4 per block in int4) and as much back, and the servers apply arrivals strictly in the order of
their numbers (every slice, every part of a tensor / pipeline parallel replica, sees one order).
A replica reads theta when its own arrival is in; arrivals after it may be in too (less staleness,
and the order stays the numbers' order). Encoding is DiLoCo's (hpctrain/sync/compress.py); pushes go
without error feedback, as there.

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
                 kind: str, block: int):
        self.comm, self.servers, self.bounds, self.kind = comm, servers, bounds, kind
        self.n_replicas = n_replicas
        self.codecs, self.slot_bytes = [], []
        for lo, hi in bounds:
            chunk, blk = wire_layout(hi - lo, 1, kind, block)
            self.codecs.append(Codec(kind, chunk, blk))
            self.slot_bytes.append(encoded_bytes(chunk, kind, blk))
        me = servers.index(comm.rank) if comm.rank in servers else None
        self.me = me
        self.pull_words = 1 + 2 * n_replicas  # the first pull word
        words = 1 + 4 * n_replicas if me is not None else 0
        slots = 2 * n_replicas * self.slot_bytes[me] if me is not None else 0  # pushes, then pulls
        self.header = MPI.Win.Allocate(8 * words, disp_unit=8, comm=comm)
        self.slots = MPI.Win.Allocate(slots, disp_unit=1, comm=comm)
        if me is not None:
            np.frombuffer(self.header.tomemory(), dtype=np.int64)[:] = 0
        self.next_arrival = 1
        self.answered = [0] * n_replicas  # server: the last pull answered, per replica
        self.views = None  # server: (n_replicas, slice) fp32, what each replica holds (set_views)
        comm.Barrier()

    def set_views(self, replica: int, start: np.ndarray | None) -> None:
        """Collective: every replica (comm rank = replica) sends its weights `start` (flat fp32,
        its part) to the servers, which keep them as its view. At start and on resume."""
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
    def post(self, replica: int, arrival: int, g: np.ndarray, lr_scale: float) -> int:
        """Put pseudo-gradient `g` (flat fp32, this rank's part) encoded into slot `replica` of
        every server, then publish `arrival`; bytes sent."""
        sent = 0
        for s, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds)):
            codec = self.codecs[s]
            padded = torch.zeros(codec.chunk, dtype=torch.float32)
            padded[:hi - lo] = torch.from_numpy(g[lo:hi])
            payload = torch.cat(codec.encode(padded)).numpy()
            words = np.array([arrival, np.float64(lr_scale).view(np.int64)], dtype=np.int64)
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
        return sent

    def pull(self, replica: int, at: int, start: np.ndarray) -> tuple[np.ndarray, int]:
        """Ask every server for the change since my last pull once arrival `at` is applied;
        (start + the decoded changes: my new weights, as the servers' view of them; bytes moved)."""
        word = np.array([at], dtype=np.int64)
        for server in self.servers:
            self.header.Lock(server, MPI.LOCK_SHARED)
            self.header.Accumulate([word, MPI.INT64_T], server, target=(self.pull_words + 2 * replica, 1, MPI.INT64_T),
                                   op=MPI.REPLACE)
            self.header.Unlock(server)
        theta, moved = start.copy(), 0
        for s, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds)):
            self._wait_word(server, self.pull_words + 2 * replica + 1, at)
            size = self.slot_bytes[s]
            raw = np.empty(size, dtype=np.uint8)
            self.slots.Lock(server, MPI.LOCK_SHARED)
            self.slots.Get([raw, MPI.BYTE], server, target=((self.n_replicas + replica) * size, size, MPI.BYTE))
            self.slots.Unlock(server)
            codec = self.codecs[s]
            theta[lo:hi] = start[lo:hi] + codec.decode(codec.split(torch.from_numpy(raw)))[:hi - lo].numpy()
            moved += size + 16
        return theta, moved

    def _wait_word(self, server: int, index: int, at_least: int, poll_s: float = 0.0002) -> None:
        word, out = np.zeros(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        while True:
            self.header.Lock(server, MPI.LOCK_SHARED)
            self.header.Fetch_and_op([word, MPI.INT64_T], [out, MPI.INT64_T], server, index, MPI.NO_OP)
            self.header.Unlock(server)
            if out[0] >= at_least:
                return
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
        applied arrival; how many arrivals were applied. `apply(g_slice, arrival, lr_scale)`
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
            apply(self._decode(replica), self.next_arrival, lr_scale)
            me, word = self.comm.rank, np.array([self.next_arrival], dtype=np.int64)
            self.header.Lock(me, MPI.LOCK_SHARED)
            self.header.Accumulate([word, MPI.INT64_T], me, target=(APPLIED, 1, MPI.INT64_T), op=MPI.REPLACE)
            self.header.Unlock(me)
            self.next_arrival += 1
            done += 1

    def _answer_pulls(self, header: np.ndarray, theta) -> None:
        asked = header[self.pull_words::2]
        for r in np.nonzero((asked > np.array(self.answered)) & (asked < self.next_arrival))[0]:
            codec, size, me = self.codecs[self.me], self.slot_bytes[self.me], self.comm.rank
            view = self.views[r]
            padded = torch.zeros(codec.chunk, dtype=torch.float32)
            padded[:view.size] = torch.from_numpy(theta() - view)
            parts = codec.encode(padded)
            view += codec.decode(parts)[:view.size].numpy()  # what the replica adds: error feedback
            payload = torch.cat(parts).numpy()
            self.slots.Lock(me, MPI.LOCK_EXCLUSIVE)
            self.slots.Put([payload, MPI.BYTE], me, target=((self.n_replicas + r) * size, size, MPI.BYTE))
            self.slots.Unlock(me)
            self.answered[r] = int(asked[r])
            word = np.array([asked[r]], dtype=np.int64)
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
