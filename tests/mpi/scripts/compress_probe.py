"""Compressed averaging probe: each rank averages its own real-valued vector in every wire format
and writes OUTDIR/rank<r>.json with its input and results (the test checks bounds and identity),
then 20 rounds of int4 averages with and without error feedback beside the fp32 ones.

usage: compress_probe.py OUTDIR
"""
import json
import sys

import torch

from hpctrain.distributed import init_distributed, run_or_abort, teardown
from hpctrain.sync.compress import average


def main():
    ctx = init_distributed(timeout_s=60)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    # pseudo-gradient-like: mostly small values, a few large ones, one odd length (padding)
    x = torch.randn(3001, generator=g) * 1e-3
    x[:: 97] *= 50
    out = {"x": x.tolist()}
    for kind, block in [("none", 0), ("bf16", 0), ("int8", 64), ("int8", 0), ("int4", 64),
                        ("int4", 0)]:
        out[f"{kind}/{block}"] = average(x, None, kind, block).tolist()
    # 20 rounds of fresh vectors: the sum of the int4 averages with and without error feedback,
    # and of the fp32 ones (the reference), with the residuals left after the last round
    sums = {kind: torch.zeros_like(x) for kind in ("none", "int4", "int4_ef")}
    e_sent, e_owned = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(20):
        xk = torch.randn(3001, generator=g) * 1e-3
        sums["none"] += average(xk, None, "none")
        sums["int4"] += average(xk, None, "int4", 64)
        sums["int4_ef"] += average(xk, None, "int4", 64, feedback=(e_sent, e_owned))
    out["sums"] = {kind: v.tolist() for kind, v in sums.items()}
    out["e_sent"], out["e_owned"] = e_sent.tolist(), e_owned.tolist()
    with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
        json.dump(out, f)
    teardown()


if __name__ == "__main__":
    # a failing rank ends the job (no peer left in a collective); a finished one ends as `hpctrain
    # train` does (MPI_Finalize, the launcher told, os._exit), without ~0.8 s of teardown per rank
    from hpctrain.__main__ import exit_without_teardown

    exit_without_teardown(run_or_abort(main))
