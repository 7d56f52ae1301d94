"""GPU-path safety checks that run on CPU (shared/GPU.md): device tensors only in default-group
collectives, one distinct GPU per rank (PBT members included), and the precision / TF32 decisions.

How item 1 is held on CPU: NCCL refuses any CPU tensor ("No backend type associated with device
type cpu"); a default group made as `init_process_group("cuda:gloo")` refuses them the same way
(checked below), but on a CPU machine it refuses every tensor, so the step cannot run under it.
The workers instead give the default group a backend for CPU only ("cpu:gloo") and make torch's
default device "meta": a tensor the code builds without naming its device (the class of defect:
a host tensor where the rank's device was meant) lands on meta. Meta tensors never reach a backend
(their kernels are fakes), so the workers' collectives refuse any tensor off the rank's device with
NCCL's message before calling the real one; tensors built on the rank's device (CPU) go through.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import mpiexec_path, run_cmd
from tests.shared_dirs import shared_dir

# Every check that needs processes runs in ONE 2-rank mpiexec launch (the module's `two_ranks`
# fixture; one launch instead of six processes: ~45 s less on 2 cores), section after section, each
# rank's lines gathered to rank 0 and printed as "rank R: SECTION ...". Rank 0 is started with the
# user's MPIR_CVAR_ENABLE_GPU=1 (an MPMD launch: argv[2] "user"), rank 1 without it.
HEAD_SECTION = """
import os, sys, time, types
for key in ("MPIR_CVAR_ENABLE_GPU", "OMPI_MCA_opal_cuda_support"):
    os.environ.pop(key, None)
if sys.argv[2] == "user":  # the user asked MPI for GPU memory
    os.environ["MPIR_CVAR_ENABLE_GPU"] = "1"
from hpctrain.distributed.bootstrap import _mpi
MPI = _mpi()  # MPI_Init: what MPI was told about GPU memory must be in the environment by now
comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
out = ["host_memory_only " + " ".join(os.environ.get(key, "unset") for key in
                                     ("MPIR_CVAR_ENABLE_GPU", "OMPI_MCA_opal_cuda_support"))]
import torch, torch.distributed as dist

# the premise: a "cuda:gloo" default group refuses a CPU tensor as NCCL does
dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    dist.all_reduce(torch.zeros(1))
    out.append("premise accepted")
except RuntimeError as e:
    out.append("premise refused: " + str(e).splitlines()[0])
dist.destroy_process_group()
"""
TAIL_SECTION = """
every = comm.gather(out, root=0)
if rank == 0:
    print("\\n".join(f"rank {r}: {line}" for r, lines in enumerate(every) for line in lines))
teardown()  # without it the gloo group's threads can abort the exit ("terminate called ...")
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The worker's launch: {section: [its lines, rank 0's first]}, and the process (its
    returncode, stdout, stderr), launched once per session (tests/shared_dirs.py: xdist splits the
    tests that read it between its workers)."""
    def launch(tmp):
        script = tmp / "worker.py"
        script.write_text(HEAD_SECTION + SITES + GROUPS + STAGING + TAIL_SECTION)
        python = [sys.executable, script, tmp / "run"]  # rank 0 as a user who set MPIR_CVAR_ENABLE_GPU
        r = run_cmd([mpiexec_path(), "-n", "1", *python, "user", ":", "-n", "1", *python, "none"],
                    timeout=300)
        (tmp / "process.json").write_text(json.dumps(
            {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}))
    tmp = shared_dir(tmp_path_factory, "gpu_safety_worker", launch)
    r = SimpleNamespace(**json.loads((tmp / "process.json").read_text()))
    sections: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        if line.startswith("rank ") and ": " in line:
            who, rest = line.split(": ", 1)
            sections.setdefault(rest.split()[0], []).append(f"{who}: {rest}")
    return sections, r


def section(two_ranks, name) -> list[str]:
    sections, r = two_ranks
    assert r.returncode == 0 and name in sections, r.stdout + r.stderr
    return sections[name]


@pytest.mark.mpi
def test_cuda_gloo_group_refuses_cpu_tensors_like_nccl(two_ranks):
    assert section(two_ranks, "premise") == \
        [f"rank {r}: premise refused: No backend type associated with device type cpu" for r in (0, 1)]


@pytest.mark.mpi
def test_mpi_is_told_host_memory_only_before_mpi_init(two_ranks):
    """MPI is told host memory only (both keys "0") unless the user set MPIR_CVAR_ENABLE_GPU=1
    (rank 0): the user's wins."""
    assert section(two_ranks, "host_memory_only") == \
        ["rank 0: host_memory_only 1 0", "rank 1: host_memory_only 0 0"]


# Each site of the step / metrics / checkpoint / sync code that puts a tensor into a collective
# of the default group (or of a group made from it, which inherits its backend), with the device
# the trainer gives it. Rank 1 holds no gradients (a rank without a shard of the weights).
SITES = """
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
port = comm.bcast(store.port if rank == 0 else 0, root=0)
store = store or dist.TCPStore("127.0.0.1", port, 2, is_master=False)
dist.init_process_group("cpu:gloo", store=store, rank=rank, world_size=2)
cpu = torch.device("cpu")
w = torch.nn.Parameter(torch.ones(4, device=cpu))
opt = torch.optim.SGD([w], lr=0.1)
if rank == 0:
    w.grad = torch.full((4,), float("inf"), device=cpu)
torch.set_default_device("meta")

def device_only(collective):
    # meta tensors skip the backend (their kernels are fakes): refuse them here, as NCCL a CPU one
    def checked(*args, **kwargs):
        for t in args:
            if isinstance(t, torch.Tensor) and t.device != cpu:
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        return collective(*args, **kwargs)
    return checked

NAMES = ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor")
real = {name: getattr(dist, name) for name in NAMES if hasattr(dist, name)}
for name, collective in real.items():
    setattr(dist, name, device_only(collective))

def site(name, fn):
    try:
        out.append(f"site {name} ok {fn()}")
    except Exception as e:
        out.append(f"site {name} FAILED {type(e).__name__} {str(e).splitlines()[0][:160]}")

from hpctrain.train.loss_scaling import LossScaling
from hpctrain.train.bad_steps import BadStepPolicy, all_finite
from hpctrain.parallel.runner import StepRunner
from hpctrain.sync.compress import average
scaling = LossScaling(cpu, 1024.0, 100, enabled=True)
site("fp16_overflow_flag", lambda: bool(scaling.unscale_(opt) > 0))  # a device flag now
site("bad_step_vote", lambda: BadStepPolicy(3, 0, rank, 2).should_skip(
    1, torch.ones((), device=cpu), 1.0))
site("all_finite", lambda: all_finite([w], cpu))
site("pp_stage_grad_norm", lambda: dist.all_reduce(
    StepRunner._replica_grad_norm(types.SimpleNamespace(
        device=cpu, layout=types.SimpleNamespace(experts=None)), [])))
site("diloco_average_none", lambda: float(average(torch.ones(10, device=cpu), None, "none")[0]))
site("diloco_average_int8", lambda: float(average(torch.ones(10, device=cpu), None, "int8")[0]))
torch.set_default_device("cpu")
for name, collective in real.items():
    setattr(dist, name, collective)
comm.Barrier()
dist.destroy_process_group()
comm.Barrier()  # rank 0's store outlives every client
del store
"""


@pytest.mark.mpi
def test_default_group_collectives_get_device_tensors_only(two_ranks):
    lines = section(two_ranks, "site")
    failed = [ln for ln in lines if " FAILED " in ln]
    assert not failed, "\n".join(failed)
    assert len(lines) == 2 * 6 and all(" ok " in ln for ln in lines), lines  # every site, both ranks
    # rank 0's Inf reached the rank without gradients: both skip the step
    assert [ln for ln in lines if "fp16_overflow_flag" in ln] == \
        ["rank 0: site fp16_overflow_flag ok True", "rank 1: site fp16_overflow_flag ok True"]


# ---- item 2 / 10: one distinct GPU per rank ------------------------------------------------------
@pytest.mark.parametrize("node_size,visible,expected", [
    (4, 4, [0, 1, 2, 3]),   # one rank per GPU
    (4, 8, [0, 1, 2, 3]),   # fewer ranks than GPUs
    (4, 1, [0, 0, 0, 0]),   # srun --gpus-per-task=1: each task sees only its own GPU
])
def test_each_node_rank_gets_its_gpu(node_size, visible, expected):
    from hpctrain.distributed.bootstrap import cuda_device_index
    assert [cuda_device_index(r, node_size, visible) for r in range(node_size)] == expected


def test_pbt_members_on_one_node_get_distinct_gpus():
    """2 members x 2 ranks on a 4-GPU node: counted inside each member they were 0, 1, 0, 1."""
    from hpctrain.distributed.bootstrap import cuda_device_index, gpus_shared
    job_wide = [cuda_device_index(r, 4, 4) for r in range(4)]
    per_member = [cuda_device_index(r % 2, 2, 4) for r in range(4)]
    assert job_wide == [0, 1, 2, 3] and gpus_shared([str(i) for i in job_wide]) == {}
    assert gpus_shared([str(i) for i in per_member]) == {"0": [0, 2], "1": [1, 3]}


def test_more_ranks_than_gpus_is_named():
    from hpctrain.distributed.bootstrap import cuda_device_index, gpus_shared
    from hpctrain.errors import ConfigError
    ids = [f"GPU-{cuda_device_index(r, 6, 4)}" for r in range(6)]
    assert gpus_shared(ids) == {"GPU-0": [0, 4], "GPU-1": [1, 5]}
    with pytest.raises(ConfigError):
        cuda_device_index(0, 2, 0)


# ---- items 6 / 7: precision "auto" and TF32 -------------------------------------------------------
@pytest.mark.parametrize("native_bf16,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_never_picks_emulated_bf16(monkeypatch, native_bf16, expected):
    """A V100/T4 answers is_bf16_supported() True (emulation counted) and False without it."""
    import torch

    from hpctrain.train.precision import resolve_precision
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or native_bf16)
    assert resolve_precision("auto", torch.device("cuda", 0), 64, 32) == expected


@pytest.mark.parametrize("capability,tf32,expected", [
    ((9, 0), True, True), ((8, 0), True, True), ((8, 0), False, False),
    ((7, 0), True, False),   # V100: no TF32 units
    (None, True, False),     # CPU
])
def test_tf32_decision(capability, tf32, expected):
    from hpctrain.train.precision import tf32_wanted
    assert tf32_wanted(capability, tf32) is expected


def test_tf32_leaves_cpu_matmul_precision_alone():
    import torch

    from hpctrain.train.precision import apply_tf32
    before = torch.get_float32_matmul_precision()
    assert apply_tf32(torch.device("cpu"), True) is False
    assert torch.get_float32_matmul_precision() == before


# ---- item 9: dist.timeout_s on every group; a slow commit waits on host sockets -------------------
GROUPS = """
from hpctrain.distributed.bootstrap import init_distributed, group_timeout, teardown
from hpctrain.distributed.mesh import AXES, Mesh, ParallelDims
from hpctrain.parallel.parallelize import tied_weight_group
from hpctrain.sync.diloco import _dp_group
from hpctrain.checkpoint import directory
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.distributed import run_lock
ctx = init_distributed("gloo", timeout_s=5)
seen = {}
for name, dims in (("tp", ParallelDims.from_world(2, tp=2)), ("pp", ParallelDims.from_world(2, pp=2)),
                   ("dp", ParallelDims.from_world(2, dp=2))):
    mesh = Mesh(dims, ctx)
    for axis in AXES:
        seen[f"mesh_{name}2.{axis}"] = group_timeout(mesh.group(axis))
    if name == "pp":
        seen["tied_weights"] = group_timeout(tied_weight_group(mesh))
    if name == "dp":
        seen["diloco_dp"] = group_timeout(_dp_group(mesh))
mgr = CheckpointManager(sys.argv[1], keep=1, rank=ctx.rank, world_size=2, timeout_s=5)
seen["checkpoint_save"] = group_timeout(mgr.save_group())
install = directory.install
if ctx.rank == 0:  # a commit on a slow parallel file system: 8 s > dist.timeout_s
    directory.install = lambda *a: (time.sleep(8), install(*a))[1]
t0 = time.monotonic()
with run_lock.hold(sys.argv[1], ctx):
    path = mgr.save(3, {"w": torch.ones(4)}, {"step": 3})
directory.install = install
out.append(f"saved {path.name} after {time.monotonic() - t0:.1f} s")
out.extend(f"timeout {name} {timeout.total_seconds():g}" for name, timeout in seen.items())
"""


@pytest.mark.mpi
def test_every_group_has_the_timeout_and_a_slow_commit_passes(two_ranks):
    timeouts = dict(ln.split()[3:] for ln in section(two_ranks, "timeout"))
    groups = [f"mesh_{n}2.{a}" for n in ("tp", "pp", "dp") for a in ("pp", "dp", "tp")]
    assert len(section(two_ranks, "timeout")) == 2 * len(timeouts)  # both ranks, the same names
    assert {k: float(timeouts[k]) for k in groups + ["tied_weights", "diloco_dp"]} == \
        {k: 5.0 for k in groups + ["tied_weights", "diloco_dp"]}
    assert float(timeouts["checkpoint_save"]) == 1800.0
    # rank 1 waited ~8 s for rank 0's commit, past dist.timeout_s (5 s), on the save's gloo group
    saved = section(two_ranks, "saved")
    assert len(saved) == 2 and all(float(ln.split()[-2]) >= 7.5 for ln in saved), saved


# ---- item 8: DiLoCo overlap never issues NCCL from its pool thread --------------------------------
@pytest.mark.parametrize("device,overlap,on_host", [
    ("cuda", True, True),    # the pool thread averages host copies on a gloo group
    ("cuda", False, False),  # the main thread alone: NCCL on the device
    ("cpu", True, False),    # gloo already
])
def test_diloco_overlap_averages_on_host_on_gpus(device, overlap, on_host):
    import torch

    from hpctrain.sync.diloco import averages_on_host
    assert averages_on_host(torch.device(device, 0), overlap) is on_host


# ---- item 5: async staging of replicated (DDP) state: each rank stages only what it writes ---------
def test_each_replicated_tensor_is_staged_by_one_holder():
    from hpctrain.checkpoint.background import assign_writers
    both = {".a": 400, ".b": 300, ".c": 200, ".d": 100}
    owner = assign_writers([both, dict(both)])
    assert sorted(owner) == sorted(both)
    assert [sum(both[p] for p, r in owner.items() if r == rank) for rank in (0, 1)] == [500, 500]
    # a pipeline stage's tensor is staged by a rank of that stage
    owner = assign_writers([{".s0": 8, ".x": 4}, {".s1": 8, ".x": 4}])
    assert owner[".s0"] == 0 and owner[".s1"] == 1 and owner[".x"] in (0, 1)


STAGING = """
torch.manual_seed(0)  # the same replicated state on both ranks (DDP)
state = {"model": {f"w{i}": torch.randn(64, 64) for i in range(8)}, "optim": {"step": torch.ones(())}}
mgr = CheckpointManager(os.path.join(sys.argv[1], "staging"), keep=1, rank=ctx.rank, world_size=2)
with run_lock.hold(os.path.join(sys.argv[1], "staging"), ctx):
    mgr.save_async(1, state, {"step": 1})
    staged = sum(b.numel() * b.element_size() for b in mgr._staging.values())
    path = mgr.wait()
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
             "optim": {"step": torch.zeros(())}}
    mgr.load(path, fresh)
same = all(torch.equal(fresh[s][k], state[s][k]) for s in state for k in state[s])
total = sum(t.numel() * t.element_size() for s in state.values() for t in s.values())
out.append(f"staged {staged} of {total} bytes, loaded equal {same}")
"""


@pytest.mark.mpi
def test_ddp_async_staging_holds_only_this_ranks_share(two_ranks):
    lines = [ln.split() for ln in section(two_ranks, "staged")]
    assert len(lines) == 2 and all(ln[-1] == "True" for ln in lines), lines
    staged, total = [int(ln[3]) for ln in lines], int(lines[0][5])
    assert sum(staged) == total and max(staged) <= 0.6 * total, (staged, total)


# ---- item 13: NCCL's interface is the user's choice; MPI gets host memory only --------------------
@pytest.mark.parametrize("asked,user_nccl,gloo,nccl", [
    (False, None, "eth1", None),      # discovered rendezvous network: Gloo only, NCCL chooses
    (True, None, "ib0", "ib0"),       # HPCTRAIN_IFACE=ib0: both
    (True, "ib1", "ib0", "ib1"),      # the user's NCCL_SOCKET_IFNAME wins
])
def test_nccl_interface_only_when_asked(monkeypatch, asked, user_nccl, gloo, nccl):
    import os

    from hpctrain.distributed.bootstrap import _use_interface
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        # setenv first so that monkeypatch restores the variable's absence after the test:
        # _use_interface writes os.environ, and a leaked GLOO_SOCKET_IFNAME=eth1 broke every later
        # test that starts ranks ("Unable to find address for: eth1")
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    if user_nccl:
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", user_nccl)
    _use_interface(gloo, asked)
    assert (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")) == (gloo, nccl)


# ---- item 11: async_diloco's catch-up copies the update to the device, never the model back -------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_catch_up_in_place_equals_the_copy_both_ways(dtype):
    import numpy as np
    import torch

    from hpctrain.sync.asynchronous import add_into, assign, flat
    from hpctrain.sync.outer import with_updates_since
    torch.manual_seed(0)
    made = [torch.randn(33, 7), torch.randn(5)]
    a = [t.clone().to(getattr(torch, dtype)) for t in made]
    b = [t.clone().to(getattr(torch, dtype)) for t in made]
    start, theta = flat(a) + np.float32(0.01), flat(a) - np.float32(0.003)
    assign(a, with_updates_since(flat(a), start, theta))  # before: device -> host -> device
    add_into(b, theta - start)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- second review, item 6: async_diloco's push copies into one host buffer, one wait ------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flat_is_every_part_as_fp32_in_order(dtype):
    """flat() copies the parts into one host buffer (pinned, asynchronous on GPUs) instead of one
    blocking `.cpu()` each: the same fp32 vector as the per-part form, its own memory."""
    import numpy as np
    import torch

    from hpctrain.sync.asynchronous import flat
    torch.manual_seed(0)
    parts = [torch.randn(33, 7).to(getattr(torch, dtype)), torch.randn(5).to(getattr(torch, dtype)),
             torch.randn(4, 4).t()]  # a transposed (non-contiguous) one
    got = flat(parts)
    want = torch.cat([p.detach().reshape(-1).float().cpu() for p in parts]).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    got[0] += 1.0
    assert not np.array_equal(got, flat(parts))  # a copy, not a view of the parameters
