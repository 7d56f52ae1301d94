"""Overlapped (eager) DiLoCo rounds on a real process group, with the inner steps scripted so the
worst case for the eager estimate happens every round: each replica walks back its whole offset
from the global model (c = 1) on top of a shared step, after a first round with replica-specific
moves. Writes OUTDIR/rank<r>.json: per round, this replica's start point and the anchor.

usage: diloco_probe.py OUTDIR ROUNDS
"""
import json
import sys

import torch
import torch.nn as nn

from hpctrain.config import ParallelConfig, SyncConfig
from hpctrain.distributed import init_distributed, run_or_abort, teardown
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.sync.diloco import DiLoCo


def main():
    out, rounds = sys.argv[1], int(sys.argv[2])
    ctx = init_distributed(timeout_s=60)
    mesh = Mesh(ParallelDims.from_config(ctx.world_size, ParallelConfig()), ctx)
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False)
    diloco = DiLoCo(model, mesh, SyncConfig(mode="diloco", inner_steps=1, overlap=True), 10**6)
    shared = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 1e-2
    own = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + ctx.rank))
    log = []
    with torch.no_grad():
        for k in range(1, rounds + 1):
            start = model.weight.detach().clone()
            mean_start = start.clone()
            torch.distributed.all_reduce(mean_start, op=torch.distributed.ReduceOp.AVG)
            # the replica's "inner steps" move it by delta = start - local: a shared step plus, in
            # round 1, a move of its own and, later, all of its start's offset from the mean start
            delta = shared + (own if k == 1 else start - mean_start)
            model.weight.sub_(delta)
            diloco.after_step(k)
            log.append({"start": start.flatten().tolist(), "anchor": diloco.anchor[0].flatten().tolist()})
    diloco.close()
    with open(f"{out}/rank{ctx.rank}.json", "w") as f:
        json.dump(log, f)
    teardown()


if __name__ == "__main__":
    # a failing rank ends the job (no peer left in a collective); a finished one ends as `hpctrain
    # train` does (MPI_Finalize, the launcher told, os._exit), without ~0.8 s of teardown per rank
    from hpctrain.__main__ import exit_without_teardown

    exit_without_teardown(run_or_abort(main))
