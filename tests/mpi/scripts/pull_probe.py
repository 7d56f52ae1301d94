"""Compressed pulls with error feedback (hpctrain/sync/inbox.py) on 4 ranks: replicas 0 and 1,
servers 2 and 3 (each holds half of a 3001-element model). Per round one replica posts a random
pseudo-gradient (applied as theta = 0.999 theta - g), then both pull (its own arrival / a catch-up). The
servers check after every round that each replica's view is within half a quantization step of
theta (per block of the change d = theta - the view before the pull) and bit-identical to the
weights the replica holds; they write OUTDIR/server<rank>_<kind>.json. Kinds: int8, int4 (pushes
and pulls), int8-int4 (int8 pushes, int4 pulls: sync.pull_compression), int4-int4-ef (int4 with
error feedback on the pushes: sync.error_feedback). At the end each replica sends the exact sum of
its pseudo-gradients and its push residual; the servers write how far the sum they applied is from
it ("drift") and from it minus the residual ("carried": ~0 when the residual is what was left out);
the replicas write |residual| over half a step of each push's block ("push_ratios": <= 1).

usage: pull_probe.py OUTDIR
"""
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.sync.inbox import ArrivalInbox

N, ROUNDS, BLOCK = 3001, 12, 64


def half_steps(d: np.ndarray, block: int, levels: int) -> np.ndarray:
    pad = np.zeros((-d.size) % block, dtype=np.float32)
    v = np.abs(np.concatenate([d, pad])).reshape(-1, block)
    return np.repeat(v.max(1) / levels / 2, block)[:d.size]


def run(comm, kind: str, outdir: str) -> None:
    servers, rank = [2, 3], comm.rank
    bounds = [(0, N // 2), (N // 2, N)]
    rng = np.random.default_rng(7)
    theta0 = rng.standard_normal(N).astype(np.float32)
    push_kind, pull_kind, ef = (kind.split("-") + [None, None])[:3]
    inbox = ArrivalInbox(comm, servers, bounds, 2, push_kind, BLOCK, pull_kind)
    start = theta0.copy() if rank < 2 else None
    levels = 127 if push_kind == "int8" else 7
    if rank < 2 and ef == "ef":
        inbox.push_residual = np.zeros(N, dtype=np.float32)
    sums = np.zeros((2, N), dtype=np.float64)  # replica: its pseudo-gradients; server: applied, per replica
    push_ratios = []
    inbox.set_views(rank, start)
    if rank in servers:
        lo, hi = bounds[servers.index(rank)]
        theta = theta0[lo:hi].copy()
    ratios, identical, moved = [], True, []
    for a in range(1, ROUNDS + 1):
        g = (rng.standard_normal(N) * 10.0 ** rng.uniform(-4, 0, N)).astype(np.float32)
        if rank < 2:
            if rank == a % 2:
                meant = g if inbox.push_residual is None else g + inbox.push_residual
                inbox.post(rank, a, g, 1.0)
                sums[rank] += g
                if inbox.push_residual is not None:  # per server slice, in its codec's blocks
                    push_ratios.append(max(float((np.abs(inbox.push_residual[lo:hi]) / np.maximum(
                        half_steps(meant[lo:hi], inbox.codecs[s].block, levels), 1e-30)).max())
                        for s, (lo, hi) in enumerate(bounds)))
            start, nbytes = inbox.pull(rank, a, start)
            moved.append(nbytes)
            done = comm.Ibarrier()
            done.Wait()
        else:
            before = inbox.views.copy()
            done = comm.Ibarrier()

            def apply(g_slice, arrival, lr_scale, final):  # final: never here (no end of training)
                # with a decay, so the change is not on the push's quantization grid
                theta[:] = theta * np.float32(0.999) - g_slice
                sums[arrival % 2, lo:hi] += g_slice

            while not done.Test():
                inbox.serve(apply, lambda: theta.copy())
            for r in range(2):
                levels = 127 if inbox.pull_kind == "int8" else 7
                bound = half_steps(theta - before[r], inbox.pull_codecs[inbox.me].block, levels)
                err = np.abs(theta - inbox.views[r])
                ratios.append(float((err / np.maximum(bound, 1e-30)).max()))
        if rank < 2:
            for server, (lo, hi) in zip(servers, bounds):
                comm.Send(start[lo:hi].copy(), dest=server, tag=a)
        else:
            for r in range(2):
                got = np.empty(hi - lo, dtype=np.float32)
                comm.Recv(got, source=r, tag=a)
                identical &= bool(np.array_equal(got, inbox.views[r]))
        # the servers' checks see this round only: no replica posts the next arrival before they
        # are done (a server still inside serve() when the meeting ends would apply it, and answer
        # the next pull, before comparing this round's weights)
        comm.Barrier()
    drift = carried = 0.0
    if rank < 2:
        residual = inbox.push_residual if inbox.push_residual is not None else np.zeros(N, dtype=np.float32)
        for server, (lo, hi) in zip(servers, bounds):
            comm.Send(np.concatenate([sums[rank, lo:hi], residual[lo:hi]]), dest=server, tag=99)
    else:
        for r in range(2):
            got = np.empty(2 * (hi - lo), dtype=np.float64)
            comm.Recv(got, source=r, tag=99)
            left = got[:hi - lo] - sums[r, lo:hi]
            drift, carried = max(drift, np.abs(left).max()), max(carried, np.abs(left - got[hi - lo:]).max())
    if rank in servers:
        out = {"ratios": ratios, "identical": identical, "slot_bytes": inbox.slot_bytes,
               "pull_bytes": inbox.pull_bytes, "drift": float(drift), "carried": float(carried)}
        with open(f"{outdir}/server{rank}_{kind}.json", "w") as f:
            json.dump(out, f)
    elif rank == 0:
        with open(f"{outdir}/replica0_{kind}.json", "w") as f:
            json.dump({"moved": moved, "push_ratios": push_ratios}, f)
    comm.Barrier()
    inbox.free()


if __name__ == "__main__":
    torch.set_num_threads(1)
    for kind in ("int8", "int4", "int8-int4", "int4-int4-ef"):
        run(MPI.COMM_WORLD, kind, sys.argv[1])
