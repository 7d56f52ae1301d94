"""Launch probe: bootstrap, one all-reduce, write OUTDIR/rank<r>.json; optionally fail on rank FAIL.

usage: launch_probe.py OUTDIR [FAIL_RANK]
"""
import json
import sys
import time

import torch
import torch.distributed as dist

from hpctrain.distributed import init_distributed, run_or_abort, teardown


def main():
    ctx = init_distributed(timeout_s=60)
    x = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(x)
    view = json.dumps({"rank": ctx.rank, "world": ctx.world_size, "local_rank": ctx.local_rank,
                      "local_size": ctx.local_size, "node_rank": ctx.node_rank, "n_nodes": ctx.n_nodes,
                      "backend": ctx.backend, "threads": ctx.threads, "torch_threads": torch.get_num_threads(),
                      "port": ctx.master_port, "addr": ctx.master_addr, "sum": x.item()})
    with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
        f.write(view)
    if len(sys.argv) > 2 and ctx.rank == int(sys.argv[2]):
        raise RuntimeError(f"injected failure on rank {ctx.rank}")
    if len(sys.argv) > 2:
        time.sleep(0.5)
        dist.barrier()  # the healthy ranks would block here forever without abort-on-error
    teardown()


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
