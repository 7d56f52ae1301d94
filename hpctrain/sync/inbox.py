"""Compressed pushes for sync.mode = "async_diloco" (sync.compression = "bf16" | "int8").

Without compression a replica applies its own arrival: it locks the servers' slices, reads
[theta | momentum | accumulator] and writes them back, 24 bytes per parameter, and a smaller
pseudo-gradient would not shorten that. With compression the server ranks apply the arrivals:

  replica  arrival number k from the shared counter -> Put its encoded pseudo-gradient slice (and
           the round's mean inner lr) into its own slot on every server of its part -> Flush ->
           publish k in the slot's header (an atomic REPLACE) -> wait until each server's
           `applied` word reaches k -> Get theta (fp32)
  server   while it waits in the meeting: a header holding `applied + 1` -> decode that slot ->
           apply the outer update to its own memory under an exclusive lock on itself -> applied += 1

So an arrival moves the encoded push (2 bytes per parameter in bf16; 1 + 4 per int8 block of
sync.int8_block in int8) and a 4-byte theta, and the servers apply arrivals strictly in the order of
their numbers (every slice, every part of a tensor / pipeline parallel replica, sees one order).
A replica reads theta when its own arrival is in; arrivals after it may be in too (less staleness,
and the order stays the numbers' order). Encoding is DiLoCo's (hpctrain/sync/compress.py), without
error feedback, as there.

Owns: the inbox windows and this protocol; not the outer update's arithmetic (the caller's `apply`).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.plan.wire import encoded_bytes, wire_layout
from hpctrain.sync.compress import Codec

APPLIED = 0  # header word 0 on every server; then (arrival, lr_scale bits) per replica


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
        words = 1 + 2 * n_replicas if me is not None else 0
        slots = n_replicas * self.slot_bytes[me] if me is not None else 0
        self.header = MPI.Win.Allocate(8 * words, disp_unit=8, comm=comm)
        self.slots = MPI.Win.Allocate(slots, disp_unit=1, comm=comm)
        if me is not None:
            np.frombuffer(self.header.tomemory(), dtype=np.int64)[:] = 0
        self.next_arrival = 1
        comm.Barrier()

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

    def wait_applied(self, arrival: int, poll_s: float = 0.0002) -> None:
        """Until every server has applied arrival number `arrival`."""
        word, out = np.zeros(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        for server in self.servers:
            while True:
                self.header.Lock(server, MPI.LOCK_SHARED)
                self.header.Fetch_and_op([word, MPI.INT64_T], [out, MPI.INT64_T], server, APPLIED, MPI.NO_OP)
                self.header.Unlock(server)
                if out[0] >= arrival:
                    break
                time.sleep(poll_s)

    # ---- server side ----------------------------------------------------------------------------
    def _read_header(self) -> np.ndarray:
        out = np.empty(1 + 2 * self.n_replicas, dtype=np.int64)
        me = self.comm.rank
        self.header.Lock(me, MPI.LOCK_SHARED)
        self.header.Get_accumulate([np.empty_like(out), MPI.INT64_T], [out, MPI.INT64_T], me,
                                   target=(0, out.size, MPI.INT64_T), op=MPI.NO_OP)
        self.header.Unlock(me)
        return out

    def serve(self, apply) -> int:
        """Server: apply every posted arrival that is next in order; how many were applied.
        `apply(g_slice, arrival, lr_scale)` updates this server's memory (the caller locks it)."""
        done = 0
        while True:
            header = self._read_header()
            posted = header[1::2]
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

    def free(self) -> None:
        self.header.Free()
        self.slots.Free()
