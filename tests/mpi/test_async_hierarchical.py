"""async_diloco across groups of nodes (sync.replica_nodes) under a real mpiexec with pretend nodes
(HPCTRAIN_RANKS_PER_NODE = 2): DDP over a node's 2 ranks inside a replica, the servers on the last
node. One replica of 2 ranks is the flat one-rank-replica run at the same global batch; 2 replicas
hold bit-identical weights inside and differ from each other between rounds; every batch index is
trained once; a checkpoint resumes bit for bit; layouts that do not fit fail with one line."""
import json

import pytest
import torch

from tests.conftest import ROOT, losses, mpirun, records
from tests.helpers import copy_run_at, train, write_config
from tests.mpi.test_diloco import model_parameters
from tests.mpi.test_hierarchical import HIER_GPT, TWO_RANK_NODES
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

ASYNC = ["--sync.mode=async_diloco", "--sync.inner_steps=2", "--sync.outer_momentum=0.5",
         "--train.eval_interval=0", "--train.steps=8"]
HIER = [*ASYNC, "--sync.replica_nodes=1", "--sync.ps_servers=2"]  # servers: the last node's 2 ranks
DDP_INSIDE = [*HIER, "--checkpoint.interval=4", "--checkpoint.keep=3"]


@pytest.fixture(scope="module")
def ddp_inside(tmp_path_factory, dataset):
    """(its stderr, run dir) of HIER_GPT as 1 replica of one 2-rank node (DDP inside) + 2 servers
    (DDP_INSIDE: checkpoints at steps 4 and 8), trained once per session (tests/shared_dirs.py):
    the hierarchical run here and the DDP-inside side of test_async_hierarchical_fsdp.py."""
    def build(out):
        cfg, _ = write_config(out, dataset, "hier", HIER_GPT)
        r = train(4, cfg, *DDP_INSIDE, env=TWO_RANK_NODES)
        (out / "stderr.txt").write_text(r.stderr)
    out = shared_dir(tmp_path_factory, "async_hier_ddp_inside", build)
    return (out / "stderr.txt").read_text(), out / "hier"


def model_at(run, step: int) -> dict:
    """The global model of the checkpoint of `step` (DCP, read on one process)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(run / f"checkpoints/step_{step:08d}")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def assert_step_4_resumes_bit_exact(run_b, cfg_c, run_c, hier) -> None:
    """run_c = run_b at its step-4 checkpoint, resumed on 4 ranks (2-rank nodes): steps 5..8 and
    the final global model bit for bit as run_b's."""
    copy_run_at(run_b, run_c, 4)
    r = train(4, cfg_c, *hier, env=TWO_RANK_NODES)
    assert "resumed from" in r.stderr and "step_00000004" in r.stderr
    b, c = losses(run_b), losses(run_c)
    assert [c[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)], (b, c)  # bit-identical
    mb, mc = model_at(run_b, 8)["model"], model_at(run_c, 8)["model"]
    assert sorted(mb) == sorted(mc) and mb and all(torch.equal(mb[k], mc[k]) for k in mb)


def test_one_replica_of_two_ranks_equals_the_flat_run_and_resumes_bit_exact(tmp_path, dataset, ddp_inside):
    """1 replica of one 2-rank node (DDP, 2 sequences each) + 2 servers vs 1 one-rank replica (4
    sequences) + 1 server: the same batches, the same rounds, the same outer Nesterov steps; the
    losses agree to float rounding (DDP's mean of two halves vs one mean). The hierarchical run
    resumed from its step-4 checkpoint repeats steps 5..8 and the global model bit for bit."""
    cfg_a, run_a = write_config(tmp_path, dataset, "flat", HIER_GPT)
    cfg_c, run_c = write_config(tmp_path, dataset, "resumed", HIER_GPT)
    train(2, cfg_a, *ASYNC, "--sync.ps_servers=1", "--train.micro_batch_size=4")
    stderr, run_b = ddp_inside
    assert "async_diloco: 1 replicas of 2 rank(s), 2 servers" in stderr
    assert_same_learning(run_a, run_b, 1e-5, "flat vs hierarchical")
    assert_step_4_resumes_bit_exact(run_b, cfg_c, run_c, DDP_INSIDE)


def assert_same_learning(run_a, run_b, tol: float, what: str) -> None:
    """Both runs logged steps 1..8, learned (step 8 at least 0.1 below step 1) and agree within `tol`."""
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and a[8] < a[1] - 0.1, (a, b)
    gap = max(abs(a[s] - b[s]) for s in a)
    print(f"{what}, max loss gap:", gap)
    assert gap <= tol, (gap, a, b)


def int8_push_bytes(n: int, servers: int, block: int = 256) -> int:
    """An int8 push of n parameters to `servers` slices: 1 byte per parameter (padded to whole
    blocks) + a 4-byte scale per block + a 16-byte header, per server."""
    slices = [n * (s + 1) // servers - n * s // servers for s in range(servers)]
    return sum(-(-m // block) * (block + 4) + 16 for m in slices)


def test_int8_pushes_with_error_feedback_across_groups_equal_the_flat_run_and_resume(tmp_path, dataset):
    """Compressed across groups of nodes: 1 replica of a 2-rank node + 2 servers with int8 pushes
    and pulls and error feedback vs the flat one-rank replica (4 sequences) + 1 server with the
    same: the same losses to float rounding; each arrival pushes and pulls int8 (~1 byte per
    parameter + block scales: the pusher alone crosses), not fp32; resumed from step 4 (the push
    residual checkpointed with the replica) it repeats steps 5..8 and the global model bit for bit."""
    int8 = ["--sync.compression=int8", "--sync.error_feedback=true"]
    cfg_a, run_a = write_config(tmp_path, dataset, "flat", HIER_GPT)
    cfg_b, run_b = write_config(tmp_path, dataset, "hier", HIER_GPT)
    cfg_c, run_c = write_config(tmp_path, dataset, "resumed", HIER_GPT)
    train(2, cfg_a, *ASYNC, *int8, "--sync.ps_servers=1", "--train.micro_batch_size=4")
    hier = [*HIER, *int8, "--checkpoint.interval=4", "--checkpoint.keep=3"]
    r = train(4, cfg_b, *hier, env=TWO_RANK_NODES)
    assert "1 replicas of 2 rank(s), 2 servers" in r.stderr and "int8 pushes with error feedback" in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and a[8] < a[1] - 0.1, a
    gap = max(abs(a[s] - b[s]) for s in a)
    print("flat vs hierarchical int8, max loss gap:", gap)
    assert gap <= 1e-5, (gap, a, b)
    n = model_parameters(run_b)
    arrivals = [rec for rec in records(run_b, 0) if "arrival" in rec]
    assert len(arrivals) == 4 and {rec["pushed_bytes"] for rec in arrivals} == {int8_push_bytes(n, 2)}, arrivals
    assert n < int8_push_bytes(n, 2) < 1.1 * n  # ~1 byte per parameter, not 4
    pulls = [rec["pulled_bytes"] for rec in arrivals]  # 4 full rounds: each pulls the change back
    assert pulls == [int8_push_bytes(n, 2)] * 4, pulls
    assert_step_4_resumes_bit_exact(run_b, cfg_c, run_c, hier)
    assert model_at(run_b, 4)["sync"]["replica"]["0"]["push_residual"].abs().max() > 0


def test_two_replicas_equal_inside_apart_between_rounds_every_batch_once(tmp_path, dataset):
    """2 replicas of a 2-rank node + a server node, stopped at step 4 and resumed: the inner-dp
    ranks of a replica hold bit-identical weights before and after every round they end, the two
    replicas' weights differ, and each batch index 1..8 is trained by exactly one replica across
    the stop (the claim counter's record: the leaders' metrics)."""
    cfg, run = write_config(tmp_path, dataset, "two", HIER_GPT)
    two = [*HIER, "--checkpoint.interval=4"]
    out = tmp_path / "probe"
    out.mkdir()
    r = mpirun(6, [ROOT / "tests/mpi/scripts/async_hier_probe.py", out, "train", "--config", cfg, *two,
                   "--train.stop_at_step=4"], env=TWO_RANK_NODES, check=True, timeout=600)
    assert "async_diloco: 2 replicas of 2 rank(s), 2 servers" in r.stderr
    rounds = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert rounds[0] == rounds[1] and rounds[2] == rounds[3]  # inside a replica: bit-identical
    assert {x["replica"] for x in rounds[0]} == {0} and {x["replica"] for x in rounds[2]} == {1}
    assert not {x["inner"] for x in rounds[0]} & {x["inner"] for x in rounds[2]}  # apart
    replica = model_at(run, 4)["sync"]["replica"]
    assert sorted(replica) == ["0", "1"] and not torch.equal(replica["0"]["local"], replica["1"]["local"])
    r = train(6, cfg, *two, env=TWO_RANK_NODES)
    assert "resumed from" in r.stderr and "step_00000004" in r.stderr
    steps = [rec["step"] for rank in (0, 2) for rec in records(run, rank) if "loss" in rec]
    assert sorted(steps) == list(range(1, 9)), steps  # every claimed batch once, by one replica
    arrivals = sorted(rec["arrival"] for rank in (0, 2) for rec in records(run, rank) if "arrival" in rec)
    assert arrivals == list(range(1, len(arrivals) + 1)) and len(arrivals) >= 4, arrivals


def test_layouts_that_do_not_fit_fail_with_one_line(tmp_path, dataset):
    """Servers that do not fill whole groups of nodes, and FSDP without replicas of nodes (a flat
    async replica is one dp rank: nothing to shard; FSDP inside a replica of nodes:
    test_async_hierarchical_fsdp.py): one line naming the key, no traceback."""
    cfg, _ = write_config(tmp_path, dataset, "run", HIER_GPT)
    r = train(4, cfg, *ASYNC, "--sync.replica_nodes=1", "--sync.ps_servers=1", env=TWO_RANK_NODES, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert "config key 'sync.ps_servers'" in line and "whole groups of nodes (2 ranks each)" in line, r.stderr
    r = train(1, cfg, *ASYNC, "--parallel.data_parallel=fsdp", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if "error:" in x)
    assert "config key 'parallel.data_parallel'" in line and "set sync.replica_nodes" in line, r.stderr


def test_pipeline_stages_inside_a_replica_equal_the_flat_run(tmp_path, dataset):
    """async_diloco across groups with pp = 2 inside: 1 replica of two 2-rank nodes (pp 2 x dp 2,
    2 sequences per rank) + 4 servers vs the flat replica of pp 2 (dp 1, 4 sequences) + 2 servers
    at the same global batch: each stage's pusher moves its stage's window, and the losses agree to
    float rounding (seen: 4.8e-7)."""
    cfg_h, run_h = write_config(tmp_path, dataset, "hier_pp", HIER_GPT)
    cfg_f, run_f = write_config(tmp_path, dataset, "flat_pp", HIER_GPT)
    pp = ["--parallel.pp=2", "--train.grad_accum=2"]
    r = train(8, cfg_h, *ASYNC, *pp, "--sync.replica_nodes=2", "--sync.ps_servers=4", env=TWO_RANK_NODES)
    assert "replicas=2 x (pp=2 x dp=2 (ddp) x tp=1)" in r.stderr and "1 replicas of 4 rank(s), 4 servers" in r.stderr
    train(4, cfg_f, *ASYNC, *pp, "--sync.ps_servers=2", "--train.micro_batch_size=4")
    h, f = losses(run_h), losses(run_f)
    assert sorted(h) == sorted(f) == list(range(1, 9)) and f[8] < f[1] - 0.1, f
    gap = max(abs(h[s] - f[s]) for s in f)
    assert gap <= 1e-5, (gap, h, f)
