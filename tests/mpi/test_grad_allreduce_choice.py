"""Which gradient reduction each layout gets (issue 49, defect 5): DDP reduces with its own C++
all-reduce, no Python comm hook and no pass over the gradients of ours, unless a feature needs a
hook (the MPI all-reduce: "mpi", and "auto" on CPU; PowerSGD); the straggler detector's wait is
still measured without one. FSDP2's root keeps its parameters gathered from forward to backward.

The CUDA choices are the decision function's (no GPU here); the rest runs real DDP and FSDP2 over a
2-rank gloo group under mpiexec, with real backward passes.
"""
from __future__ import annotations

import sys

import pytest

from tests.conftest import mpiexec_path, run_cmd
from tests.shared_dirs import shared_dir


@pytest.mark.parametrize("mode, device, hook", [
    ("auto", "cpu", "mpi"),      # MPI's shared-memory all-reduce: ~2x Gloo here
    ("auto", "cuda", None),      # NCCL through DDP's own reducer
    ("backend", "cpu", None), ("backend", "cuda", None),
    ("mpi", "cpu", "mpi"),
    ("powersgd", "cpu", "powersgd"), ("powersgd", "cuda", "powersgd"),
])
def test_comm_hook_only_where_a_feature_needs_it(mode, device, hook):
    import torch

    from hpctrain.parallel.parallelize import ddp_comm_hook
    assert ddp_comm_hook(mode, torch.device(device)) == hook


def test_mpi_hook_refused_on_gpus():
    import torch

    from hpctrain.errors import ConfigError
    from hpctrain.parallel.parallelize import ddp_comm_hook
    with pytest.raises(ConfigError, match="'dist.grad_allreduce'"):
        ddp_comm_hook("mpi", torch.device("cuda", 0))


# Per mode: the comm hook DDP holds (its logging data names it), and each rank's measured wait in
# a step where rank 1 computes 0.5 s longer in backward (a sleep in a gradient hook of its input).
WORKER = """
import sys, time
import torch, torch.nn as nn
from hpctrain.config_cluster import DistConfig
from hpctrain.distributed.bootstrap import init_distributed, teardown
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.metrics.wait_clock import WaitClock
from hpctrain.parallel.parallelize import apply_ddp, apply_fsdp

ctx = init_distributed("gloo", timeout_s=60)
mesh = Mesh(ParallelDims.from_world(2, dp=2), ctx)
out = []
for mode in ("auto", "backend", "powersgd"):
    torch.manual_seed(0)
    model, clock = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), WaitClock(torch.device("cpu"))
    ddp, _ = apply_ddp(model, mesh, DistConfig(grad_allreduce=mode), clock)
    hook = ddp._get_ddp_logging_data().get("comm_hook") or "none"
    for step in range(2):  # the second step is the one measured (the first builds DDP's buckets)
        x = torch.randn(4, 64, requires_grad=True)
        if ctx.rank == 1:
            x.register_hook(lambda g: time.sleep(0.5))  # the last gradient of backward: compute
        clock.begin()
        ddp(x).square().sum().backward()
        clock.backward_done()
        waited = clock.take()
    out.append(f"ddp {mode} hook={hook} waited={waited:.3f}")

class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleDict({"0": nn.Linear(16, 16)})
    def forward(self, x):
        return self.head(self.blocks["0"](self.emb(x)))

root = Root()
apply_fsdp(root, (root,), mesh, "fp32")
root(torch.randn(2, 16)).sum().backward()
kept = lambda m: m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None
out.append(f"fsdp root_keeps_params={kept(root)} block_keeps_params={kept(root.blocks['0'])}")
every = ctx.comm.gather(out, root=0)
if ctx.rank == 0:
    print("\\n".join(f"rank {r}: {line}" for r, lines in enumerate(every) for line in lines))
teardown()
"""


@pytest.fixture(scope="module")
def worker_lines(tmp_path_factory):
    """({"rank R MODE": its DDP line's key=values}, the worker's stdout), launched once per session
    (tests/shared_dirs.py: xdist splits the tests that read them between its workers)."""
    def launch(out):
        script = out / "worker.py"
        script.write_text(WORKER)
        r = run_cmd([mpiexec_path(), "-n", "2", sys.executable, script], timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        (out / "stdout.txt").write_text(r.stdout)
    stdout = (shared_dir(tmp_path_factory, "grad_allreduce_worker", launch) / "stdout.txt").read_text()
    return {line.split(": ", 1)[0] + " " + line.split()[3]: dict(kv.split("=") for kv in line.split()[4:])
            for line in stdout.splitlines() if line.startswith("rank ") and " ddp " in line}, stdout


@pytest.mark.mpi
@pytest.mark.parametrize("mode, hook", [
    ("auto", "timed_mpi_allreduce_hook"),       # CPU: the MPI hook (and its wait, timed inside it)
    ("backend", "none"),                        # DDP's own all-reduce: no Python hook
    ("powersgd", "timed_powerSGD_hook"),
])
def test_ddp_hook_per_mode_and_the_wait_still_measured(worker_lines, mode, hook):
    lines, _ = worker_lines
    assert {lines[f"rank {r} {mode}"]["hook"] for r in (0, 1)} == {hook}
    # rank 0 waited for rank 1's 0.5 s of compute, in the reduction; rank 1 hardly waited
    waited = [float(lines[f"rank {r} {mode}"]["waited"]) for r in (0, 1)]
    assert waited[0] >= 0.4 and waited[1] < 0.25, waited


@pytest.mark.mpi
def test_fsdp_root_keeps_its_parameters_from_forward_to_backward(worker_lines):
    _, stdout = worker_lines
    fsdp = [line for line in stdout.splitlines() if " fsdp " in line]
    assert fsdp == [f"rank {r}: fsdp root_keeps_params=True block_keeps_params=False" for r in (0, 1)]
