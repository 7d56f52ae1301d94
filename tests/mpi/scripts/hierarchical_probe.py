"""`hpctrain train ARGS...` as the CLI runs it, with DiLoCo's rounds watched: writes OUTDIR/rank<r>.json
with the ranks of this rank's process groups (the mesh's dp group, which DDP / FSDP and the runner
use, and DiLoCo's own averaging group) and, per step, a digest of this rank's local weights after
the inner step ("inner") and after the round hook ("after"). Nothing is changed: the hook wraps
DiLoCo.after_step and calls it.

usage: hierarchical_probe.py OUTDIR train --config CFG [overrides...]
"""
import hashlib
import json
import sys

import torch.distributed as dist

from hpctrain.sync.diloco import DiLoCo, _local

OUT = sys.argv[1]
LOG = {"steps": {}}


def digest(diloco: DiLoCo) -> str:
    h = hashlib.sha1()
    for p in diloco.params:
        h.update(_local(p).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def watch() -> None:
    init, after_step = DiLoCo.__init__, DiLoCo.after_step

    def watched_init(self, module, mesh, *args, **kw):
        init(self, module, mesh, *args, **kw)
        LOG["rank"] = mesh.rank
        LOG["dp_group"] = dist.get_process_group_ranks(mesh.group("dp"))
        LOG["outer_group"] = dist.get_process_group_ranks(self.group)

    def watched_after_step(self, step):
        inner = digest(self)
        after_step(self, step)
        LOG["steps"][step] = {"inner": inner, "after": digest(self)}
        with open(f"{OUT}/rank{LOG['rank']}.json", "w") as f:
            json.dump(LOG, f)

    DiLoCo.__init__, DiLoCo.after_step = watched_init, watched_after_step


if __name__ == "__main__":
    from hpctrain.__main__ import exit_without_teardown, main

    watch()
    exit_without_teardown(main(sys.argv[2:]))
