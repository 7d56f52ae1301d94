"""MPI worker for tests/mpi/test_checkpoint_mpi.py: real ranks, real gloo, real files.

    mpiexec -n N python ckpt_worker.py save DIR REPORT   train DDP 3 steps, save step 3, write DIR/ref.pt
    mpiexec -n N python ckpt_worker.py load DIR REPORT   fresh model, latest(), load, compare with ref.pt
    mpiexec -n N python ckpt_worker.py fail DIR REPORT   save step 1, then a save where the LAST rank
                                                         hits ENOSPC, then a load where only the
                                                         LAST rank's target state is invalid

Every rank writes lines `LATEST <rank> <path>`, `OK <rank>` (`ERR <rank> <message>` in fail mode) and,
after teardown(), `TORN <rank>` to REPORT.<rank> (ranks' stdout interleaves under mpiexec) and echoes
them to stdout. A rank ends as `hpctrain train` does (exit_without_teardown).
`save_reference` is also called in-process by the test (one rank, no process group).
It must never load anything with pickle: the reference is read with torch.load(weights_only=True).
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctrain.checkpoint import CheckpointError, CheckpointManager
from hpctrain.distributed.abort import run_or_abort
from hpctrain.distributed.bootstrap import init_distributed, teardown


def build(seed: int, steps: int, rank: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    ddp = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        nn.functional.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return ddp, opt


def flat(state: dict) -> tuple[dict, object]:
    """Tensors keyed by dotted path, plus the param_groups (JSON-comparable)."""
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].items()}
    for fqn, sub in state["optim"]["state"].items():
        for name, t in sub.items():
            out[f"optim.{fqn}.{name}"] = t.detach().clone()
    return out, state["optim"]["param_groups"]


def state_of(model, opt) -> dict:
    return dict(zip(("model", "optim"), get_state_dict(model, opt)))


class Report:
    def __init__(self, prefix: str, rank: int):
        self.f = open(f"{prefix}.{rank}", "w")

    def __call__(self, line: str) -> None:
        self.f.write(line + "\n")
        self.f.flush()
        print(line, flush=True)


def save_reference(mgr: CheckpointManager, root: Path, say) -> None:
    r, w = mgr.rank, mgr.world_size
    model, opt = build(0, 3, r)
    state = state_of(model, opt)
    mgr.save(3, state, {"step": 3, "world_size": w})
    if r == 0:
        tensors, groups = flat(state)
        torch.save({"tensors": tensors, "param_groups": repr(groups)}, root / "ref.pt")
    say(f"SAVE_S {r} {mgr.last_save_s:.3f}")


def load_and_compare(mgr: CheckpointManager, root: Path, say) -> None:
    r = mgr.rank
    ref = torch.load(root / "ref.pt", weights_only=True)
    model, opt = build(1, 0, r)
    state = state_of(model, opt)
    before, _ = flat(state)
    assert not all(torch.equal(before[k], ref["tensors"][k]) for k in before), "fresh == saved?"
    path = mgr.latest()
    say(f"LATEST {r} {path}")
    extra = mgr.load(path, state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got, groups = flat(state_of(model, opt))
    assert extra == {"step": 3, "world_size": extra["world_size"]}, extra
    assert got.keys() == ref["tensors"].keys(), (sorted(got), sorted(ref["tensors"]))
    bad = [k for k in got if not torch.equal(got[k], ref["tensors"][k])]
    assert not bad, f"rank {r}: differs after load: {bad}"
    assert repr(groups) == ref["param_groups"], (groups, ref["param_groups"])
    say(f"LOAD_S {r} {mgr.last_load_s:.3f} saved_by={extra['world_size']}")
    say(f"VERIFIED {r} {' '.join(mgr.last_verified) or '-'}")


def load_damaged(mgr: CheckpointManager, root: Path, say) -> None:
    """The test damaged a data file: every rank must refuse the load with the same line."""
    model, opt = build(1, 0, mgr.rank)
    try:
        mgr.load(mgr.latest(), state_of(model, opt))
        raise AssertionError("load of a damaged checkpoint succeeded")
    except CheckpointError as e:
        say(f"ERRLOAD {mgr.rank} {e}")


def fail_on_last_rank(mgr: CheckpointManager, root: Path, say) -> None:
    r, w = mgr.rank, mgr.world_size
    model, opt = build(0, 1, r)
    mgr.save(1, state_of(model, opt), {"step": 1})
    if r == int(os.environ.get("CKPT_FAIL_RANK", w - 1)):  # the disk fills for this rank's writes
        real = dcp_fs.FileSystem.create_stream

        def full_disk(self, path, mode):
            if "w" in mode:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(self, path, mode)
        dcp_fs.FileSystem.create_stream = full_disk
    try:
        mgr.save(2, state_of(model, opt), {"step": 2})
        raise AssertionError("save with a full disk succeeded")
    except CheckpointError as e:
        say(f"ERR {r} {e}")
    if r == 0:
        say(f"LISTING {sorted(n for n in os.listdir(root) if n.startswith('step_'))}")
    # a load where only the last rank's target state is bad must fail everywhere, not hang
    state = state_of(model, opt)
    if r == w - 1:
        state["optim"]["param_groups"][0]["bad"] = object()
    try:
        mgr.load(mgr.latest(), state)
        raise AssertionError("load into a bad state succeeded")
    except CheckpointError as e:
        say(f"ERRLOAD {r} {e}")


def main(mode: str, root: str, report: str) -> int:
    ctx = init_distributed(backend="gloo", timeout_s=60)
    r, w = ctx.rank, ctx.world_size
    say = Report(report, r)
    # CKPT_LAYOUT=node (tests/mpi/test_checkpoint_node_layout.py): nodes from HPCTRAIN_RANKS_PER_NODE
    mgr = CheckpointManager(Path(root), keep=2, rank=r, world_size=w,
                            layout=os.environ.get("CKPT_LAYOUT", "rank"), node_id=ctx.node_rank)
    {"save": save_reference, "load": load_and_compare, "fail": fail_on_last_rank,
     "load_damaged": load_damaged}[mode](
        mgr, Path(root), say)
    if mode not in ("load", "load_damaged"):
        say(f"LATEST {r} {mgr.latest()}")
    say(f"OK {r}")
    teardown()
    say(f"TORN {r}")  # past teardown's barrier and destroy_process_group
    return 0


if __name__ == "__main__":
    # ends as `hpctrain train` does: MPI_Finalize, the launcher told, os._exit; never through the
    # interpreter's teardown of torch, gloo and MPI, which the product never runs after a job
    # (imported here: the test also imports this module, and hpctrain.__main__ sets a USR1 handler)
    from hpctrain.__main__ import exit_without_teardown

    exit_without_teardown(run_or_abort(main, *sys.argv[1:4]))
