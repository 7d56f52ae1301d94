"""Compressed averaging probe: each rank averages its own real-valued vector in every wire format
and writes OUTDIR/rank<r>.json with its input and results (the test checks bounds and identity).

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
    with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
        json.dump(out, f)
    teardown()


if __name__ == "__main__":
    # a failing rank ends the job (no peer left in a collective); a finished one ends as `hpctrain
    # train` does (MPI_Finalize, the launcher told, os._exit), without ~0.8 s of teardown per rank
    from hpctrain.__main__ import exit_without_teardown

    exit_without_teardown(run_or_abort(main))
