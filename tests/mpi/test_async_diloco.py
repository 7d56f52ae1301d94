"""Asynchronous Local-SGD (sync.mode = "async_diloco") under a real mpiexec: replicas + 1 server."""
from pathlib import Path
from statistics import median

import pytest
import torch

from hpctrain import step_faults
from tests.conftest import losses, records
from tests.helpers import PREEMPT_GPT, fault_config, held_out_losses, train, write_config
from tests.processes import finish, launch, rank_pid, signal_rank_midrun
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

ASYNC = ["--sync.mode=async_diloco", "--sync.ps_servers=1"]
SLOW_RANK_1 = step_faults.env(delay_rank=1, slow_factor=2)  # replica 1 computes 2x slower


def model_parameters(cfg_path) -> int:
    import tomllib

    from hpctrain.model import build_model_from_section

    m = tomllib.loads(Path(cfg_path).read_text())["model"]
    return sum(p.numel() for p in build_model_from_section(m).parameters())


SGD = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005", "--train.grad_clip=0",
       "--train.steps=20", "--checkpoint.interval=100"]


@pytest.fixture(scope="module")
def plain_sgd(tmp_path_factory, dataset):
    """The run dir of plain SGD on 1 rank: the reference of every one-replica SGD test (trained
    once per session, tests/shared_dirs.py; the tests only read its metrics)."""
    def build(out):
        cfg, _ = write_config(out, dataset, "plain")
        train(1, cfg, *SGD)
    return shared_dir(tmp_path_factory, "async_plain_sgd", build) / "plain"


def one_replica(tmp_path, dataset, *overrides):
    """1 replica + 1 server with H = 1 and outer SGD lr 1, momentum 0 (the global model is the
    replica's after every step, so plain_sgd's curve): (async run, its result)."""
    cfg_b, run_b = write_config(tmp_path, dataset, "async")
    r = train(2, cfg_b, *SGD, *ASYNC, "--sync.inner_steps=1", "--sync.outer_optimizer=sgd",
              "--sync.outer_lr=1", "--sync.outer_momentum=0", *overrides)
    return run_b, r


def test_one_replica_one_local_step_sgd_equals_plain_sgd(tmp_path, dataset, plain_sgd):
    """1 replica, H = 1, SGD inner, outer SGD with lr 1 and no momentum: the global model is the
    replica's model after every step, so the run is plain SGD (losses within 1e-5)."""
    run_a = plain_sgd
    run_b, r = one_replica(tmp_path, dataset)
    assert "async_diloco: 1 replicas of 1 rank(s), 1 servers" in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 21)) and a[20] < a[1] - 0.5
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5, (a, b)
    va, vb = losses(run_a, "val_loss"), losses(run_b, "val_loss")
    assert abs(va[20] - vb[20]) <= 1e-5
    assert [rec["arrival"] for rec in records(run_b) if "arrival" in rec] == list(range(1, 21))
    n = model_parameters(run_b.with_suffix(".toml"))  # read and write theta, momentum, accumulator
    assert {rec["arrival_bytes"] for rec in records(run_b) if "arrival" in rec} == {24 * n}


def test_delayed_nesterov_per_lr_on_one_replica_with_one_local_step_is_sgd_with_nesterov(tmp_path, dataset):
    """1 replica, H = 1, SGD inner, delayed Nesterov with delay 1, outer lr 1 and momentum 0.5. With
    sync.momentum_per_lr an arrival moves theta by s (grad + 0.5 m), m = 0.5 m + grad (s: the
    step's lr): SGD with Nesterov momentum 0.5 under the same schedule, within 1e-5. Without it
    (the default) the momentum sums pseudo-gradients s x grad, so under the decaying schedule the
    run leaves that one."""
    cfg_a, run_a = write_config(tmp_path, dataset, "nesterov")
    train(1, cfg_a, *SGD, "--train.momentum=0.5", "--train.nesterov=true")
    a, gaps = losses(run_a), {}
    for per_lr in ("true", "false"):
        cfg_b, run_b = write_config(tmp_path, dataset, f"per_lr_{per_lr}")
        train(2, cfg_b, *SGD, *ASYNC, "--sync.inner_steps=1", "--sync.outer_optimizer=delayed_nesterov",
              "--sync.nesterov_delay=1", "--sync.outer_lr=1", "--sync.outer_momentum=0.5",
              f"--sync.momentum_per_lr={per_lr}")
        b = losses(run_b)
        assert sorted(b) == list(range(1, 21)) and b[20] < b[1] - 0.5
        gaps[per_lr] = max(abs(a[s] - b[s]) for s in a)
    assert gaps["true"] <= 1e-5 < 1e-3 < gaps["false"], gaps


def test_delayed_nesterov_at_equal_speeds_follows_synchronous_diloco(tmp_path, dataset):
    """2 replicas of equal speed + 1 server, delayed Nesterov with N = 2 replicas (the default),
    H = 4, AdamW inner, catch-up, against synchronous DiLoCo on 2 ranks with the same H, outer lr
    and momentum, over the same tokens (80 claimed batches of 4 vs 40 steps of 2 x 4, the same
    schedule per token). A round of 2 arrivals is DiLoCo's Nesterov step up to staleness, so the
    global model's held-out loss at the first and the last of 4 checkpoints stays within 4% of sync
    DiLoCo's (measured over 17 runs: 1.2-1.3% and 0.1-1.9%). The two in between are printed, not
    bounded: a checkpoint can catch the global model right after a momentum step (measured up to
    7% above, and once 6.25 against 3.32; docs/communication.md)."""
    cfg_s, run_s = write_config(tmp_path, dataset, "sync_diloco")
    cfg_a, run_a = write_config(tmp_path, dataset, "async_dn")
    train(2, cfg_s, "--sync.mode=diloco", "--sync.inner_steps=4", "--checkpoint.keep=10", "--train.eval_interval=0")
    train(3, cfg_a, *ASYNC, "--sync.inner_steps=4", "--sync.outer_optimizer=delayed_nesterov",
          "--train.steps=80", "--train.warmup_steps=10", "--checkpoint.interval=20", "--checkpoint.keep=10",
          "--train.eval_interval=0")
    sync_val, async_val = held_out_losses(run_s, dataset), held_out_losses(run_a, dataset)
    assert sorted(sync_val) == [10, 20, 30, 40] and sorted(async_val) == [20, 40, 60, 80], (sync_val, async_val)
    print("async DN vs sync DiLoCo, held-out:", [(round(sync_val[s], 4), round(async_val[2 * s], 4)) for s in sorted(sync_val)])
    gaps = [abs(async_val[2 * s] / sync_val[s] - 1) for s in (10, 40)]
    assert max(gaps) <= 0.04, (gaps, sync_val, async_val)
    assert sync_val[40] < sync_val[10] - 0.3  # both learn: the bound is not met by two flat curves


@pytest.mark.parametrize("compression, pulls, tol", [("bf16", "same", 4e-4), ("int8", "int4", 3e-3)])
def test_compressed_pushes_are_applied_by_the_server_and_stay_close_to_plain_sgd(tmp_path, dataset,
                                                                                  plain_sgd, compression,
                                                                                  pulls, tol):
    """1 replica, H = 1, SGD, outer lr 1: with bf16 / int8 pushes the server decodes and applies
    each pseudo-gradient, so the run stays within the codec's error of plain SGD (measured max loss
    gap 4.1e-5 in bf16, 7.5e-5 in int8; 10x that allowed), and an arrival moves exactly the encoded
    push (+16 header bytes), not the 24n of the uncompressed arrival that reads and writes theta,
    momentum and accumulator. bf16, outer SGD: every arrival's change is the replica's own, from
    the first (the servers' view of it starts as the initial model): nothing is pulled (inbox.py).
    int8 pushes with sync.pull_compression = int4, outer delayed Nesterov with momentum 0 (SGD's
    numbers, but every arrival takes a momentum step, so it pulls) and sync.defer_momentum_pull:
    every other arrival pulls the change in int4 (~n/2 bytes), its error fed back into the next
    pull; the others owe their momentum step to it and pull nothing (measured gap 9.5e-4 with
    every arrival pulling; 3e-3 allowed)."""
    run_a = plain_sgd
    outer = ["--sync.outer_optimizer=delayed_nesterov", "--sync.defer_momentum_pull=true"] if pulls != "same" else []
    run_b, r = one_replica(tmp_path, dataset, f"--sync.compression={compression}",
                           f"--sync.pull_compression={pulls}", *outer)
    assert f"{compression} pushes" + ("" if pulls == "same" else f", {pulls} pulls") in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(b) == list(range(1, 21)) and b[20] < b[1] - 0.5
    gap = max(abs(a[s] - b[s]) for s in a)
    assert gap <= tol, (gap, a, b)
    assert abs(losses(run_a, "val_loss")[20] - losses(run_b, "val_loss")[20]) <= tol
    n = model_parameters(run_b.with_suffix(".toml"))
    padded = -(-n // 256) * 256
    push = 2 * n if compression == "bf16" else padded + padded // 256 * 4
    pull = 0 if pulls == "same" else padded // 2 + padded // 256 * 4 + 16
    arrivals = [rec for rec in records(run_b) if "arrival" in rec]
    assert [(rec["pushed_bytes"], rec["pulled_bytes"]) for rec in arrivals] == [(push + 16, 0), (push + 16, pull)] * 10
    assert [rec["arrival_bytes"] for rec in arrivals] == [push + 16, push + 16 + pull] * 10


def test_int4_pushes_with_error_feedback_carry_their_residual_across_a_resume(tmp_path, dataset, plain_sgd):
    """sync.error_feedback with int4 pushes (1 replica, H = 1, SGD, outer lr 1): what a push's
    codes left out rides the next push, so the run stays near plain SGD (straight 20-step runs:
    step-20 val loss gap 8.8e-5 with feedback vs 6.8e-4 without, max train loss gap 9.8e-4 vs
    1.6e-3; 3e-4 and 4e-3 allowed), and the residual is the replica's state: in the step-10
    checkpoint (nonzero) and back in the run resumed from it."""
    import torch.distributed.checkpoint as dcp

    common = ["--sync.compression=int4", "--sync.error_feedback=true", "--checkpoint.interval=10"]
    run_b, _ = one_replica(tmp_path, dataset, *common, "--train.stop_at_step=10")
    ckpt = next((run_b / "checkpoints").glob("step_*10"))
    keys = [k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if "push_residual" in k]
    assert len(keys) == 1, keys
    saved = {keys[0]: torch.zeros(model_parameters(run_b.with_suffix(".toml")))}
    dcp.load(saved, checkpoint_id=str(ckpt), no_dist=True)
    assert 0 < saved[keys[0]].abs().max() < 0.01  # under half an int4 step of a pseudo-gradient
    _, r = one_replica(tmp_path, dataset, *common)
    assert "resumed from" in r.stderr and "int4 pushes with error feedback" in r.stderr
    a, b = losses(plain_sgd), losses(run_b)
    assert sorted(b) == list(range(1, 21)) and b[20] < b[1] - 0.5
    gap = max(abs(a[s] - b[s]) for s in a)
    assert gap <= 4e-3, (gap, a, b)
    val_gap = abs(losses(plain_sgd, "val_loss")[20] - losses(run_b, "val_loss")[20])
    assert val_gap <= 3e-4, val_gap  # without the residual: 6.8e-4


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_a_tensor_or_pipeline_parallel_replica_with_one_local_step_equals_its_plain_layout(tmp_path, dataset, layout):
    """1 replica of 2 ranks (tp = 2 or pp = 2) + 2 servers (one per position: each holds that
    rank's part of the global model), H = 1, SGD, outer SGD lr 1: the same losses as the plain
    2-rank layout (within 1e-5), so every part of the model goes through its own windows."""
    sgd = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005", "--train.grad_clip=0",
           "--train.steps=12", "--checkpoint.interval=100", f"--parallel.{layout}=2",
           f"--train.grad_accum={2 if layout == 'pp' else 1}"]  # a pipeline needs >= 2 micro-batches
    cfg_a, run_a = write_config(tmp_path, dataset, "plain")
    cfg_b, run_b = write_config(tmp_path, dataset, "async")
    train(2, cfg_a, *sgd)
    r = train(4, cfg_b, *sgd, "--sync.mode=async_diloco", "--sync.ps_servers=2", "--sync.inner_steps=1",
              "--sync.outer_optimizer=sgd", "--sync.outer_lr=1", "--sync.outer_momentum=0")
    assert "async_diloco: 1 replicas of 2 rank(s), 2 servers" in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 13)) and a[12] < a[1] - 0.3
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5, (a, b)
    assert abs(losses(run_a, "val_loss")[12] - losses(run_b, "val_loss")[12]) <= 1e-5
    assert [rec["arrival"] for rec in records(run_b) if "arrival" in rec] == list(range(1, 13))
    assert not (Path(run_b) / "metrics.rank1.jsonl").exists()  # one metrics file per replica


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_two_tensor_parallel_replicas_train_every_batch_once_across_a_resume(tmp_path, dataset, compression):
    """2 replicas of tp = 2 + 2 servers (6 ranks), delayed Nesterov: stopped at 20 and resumed,
    the replicas' leaders (ranks 0 and 2) together train every batch exactly once, both arrive,
    the arrival numbers are 1..n without a gap, and the global model learns. With int8 pushes the
    servers apply the arrivals, in the numbers' order on both parts of the model."""
    cfg, run = write_config(tmp_path, dataset, "tp_replicas")
    common = ["--sync.mode=async_diloco", "--sync.ps_servers=2", "--parallel.tp=2", "--sync.inner_steps=4",
              "--sync.outer_optimizer=delayed_nesterov", "--train.steps=40", "--checkpoint.interval=20",
              "--train.eval_interval=0", f"--sync.compression={compression}"]
    train(6, cfg, *common, "--train.stop_at_step=20")
    r = train(6, cfg, *common)
    assert "resumed from" in r.stderr and "at step 20" in r.stderr
    first, second = records(run, 0), records(run, 2)
    steps = [rec["step"] for rec in first + second if "loss" in rec]
    assert sorted(steps) == list(range(1, 41))
    arrivals = sorted(rec["arrival"] for rec in first + second if "arrival" in rec)
    assert arrivals == list(range(1, len(arrivals) + 1)) and len(arrivals) >= 8
    assert {rec["replica"] for rec in first + second if "arrival" in rec} == {0, 1}
    assert losses(run, "val_loss")[40] < 4.5  # from ~5.5 (uniform over 257 bytes)


def test_a_2x_slower_replica_takes_half_the_local_steps_and_every_batch_once(tmp_path, dataset):
    """2 replicas + 1 server, replica 1 computes 2x slower (a slow_factor test fault), dynamic local
    steps: replica 1 settles at about half of replica 0's steps per round; the fast replica trains
    more batches; every batch index is trained exactly once, across a stop and resume. Outer SGD:
    its global model is steady run to run (delayed Nesterov with dynamic steps is not yet: final
    val 3.3-5.6 over 14 runs of this size, see docs/communication.md)."""
    cfg, run = write_config(tmp_path, dataset, "uneven")
    common = [*ASYNC, "--sync.local_steps=dynamic", "--sync.inner_steps=8", "--train.steps=60",
              "--sync.outer_optimizer=sgd",
              "--checkpoint.interval=30", "--train.eval_interval=0"]
    train(3, cfg, *common, "--train.stop_at_step=30", env=SLOW_RANK_1)
    r = train(3, cfg, *common, env=SLOW_RANK_1)
    assert "resumed from" in r.stderr and "at step 30" in r.stderr
    fast, slow = records(run, 0), records(run, 1)
    fast_steps = [rec["step"] for rec in fast if "loss" in rec]
    slow_steps = [rec["step"] for rec in slow if "loss" in rec]
    assert sorted(fast_steps + slow_steps) == list(range(1, 61))  # each batch once, none lost
    assert len(fast_steps) > len(slow_steps)
    # DyLU plans round(8 x fastest step time / mine) from each round's mean step time: 4 for a 2x
    # slower replica, 8 for the fastest. A round's mean on a loaded 2-core machine can be off by
    # up to 2x (measured: the slow replica planned [2, 4, 4, 8, 5] when one fast round ran as slow
    # as its own; a CI at load 9: [4, 3, 1, 4, 2]), so single rounds are not bounded, their
    # median is (fixed steps: all 8)
    planned = [rec["next_local_steps"] for rec in slow if "next_local_steps" in rec]
    assert len(planned) >= 3 and 2 <= median(planned[1:]) <= 5, planned  # ~8 / 2
    assert median([rec["next_local_steps"] for rec in fast if "next_local_steps" in rec]) >= 7
    others = [rec["staleness"] + rec["caught_up"] for rec in fast + slow if "arrival" in rec]
    assert max(others) >= 1  # the other replica's arrivals in between: asynchronous
    late = [rec["loss"] for rec in fast + slow if rec.get("step", 0) > 50 and "loss" in rec]
    assert sum(late) / len(late) < 4.0  # both replicas learn, from ~5.5 (uniform over 257 bytes)
    assert losses(run, "val_loss")[60] < 3.8  # the global model holds their work (3.45 seen)


@pytest.mark.parametrize("catch_up", ["true", "false"])
def test_a_replica_adds_the_others_arrivals_to_its_weights_mid_round(tmp_path, dataset, catch_up):
    """2 replicas + 1 server, replica 1 2x slower, fixed H = 4: between two of its own arrivals a
    replica sees the others' arrivals either added to its weights at a step (caught_up) or not
    (staleness), never both and never lost: caught_up + staleness = the others' arrivals in
    between, on every record. With sync.catch_up the slow replica adds the fast one's arrivals
    mid-round; without, it never does. 50 steps = 4k + 2: whatever the timing, at least one
    replica's last round is cut short by the end of training (its arrival applies its share
    alone: test_the_last_partial_round_...). The final val bound: 3.41-3.56 in 7 of 8 runs at load
    12, 4.04 once (the global model caught right after a full round's momentum step, as in
    test_delayed_nesterov_at_equal_speeds...); with the partial round's momentum step (before the
    fix) 3.42-3.61 and 3.77, 4.28, 7.69."""
    cfg, run = write_config(tmp_path, dataset, f"catch_up_{catch_up}")
    r = train(3, cfg, *ASYNC, "--sync.inner_steps=4", "--train.steps=50", "--checkpoint.interval=100",
              "--train.eval_interval=0", f"--sync.catch_up={catch_up}", env=SLOW_RANK_1)
    assert ("catch-up" in r.stderr) == (catch_up == "true")
    seen, last_rounds = {}, []
    for replica in (0, 1):
        arrivals = [rec for rec in records(run, replica) if "arrival" in rec]
        last_rounds.append(arrivals[-1]["local_steps"])
        previous = [0] + [rec["arrival"] for rec in arrivals[:-1]]
        for rec, before in zip(arrivals, previous):
            assert rec["caught_up"] + rec["staleness"] == rec["arrival"] - before - 1, rec
        seen[replica] = sum(rec["caught_up"] for rec in arrivals)
    if catch_up == "true":
        assert seen[1] >= 2, seen  # the fast replica arrives ~twice per slow round
    else:
        assert seen == {0: 0, 1: 0}
    assert min(last_rounds) < 4, last_rounds  # a partial last round (4k + 2 steps in all)
    assert losses(run, "val_loss")[50] < 4.2  # the global model learns (from ~5.5)


def checkpoint_tensors(ckpt, names) -> dict:
    """{name: tensor} of the checkpoint's entries `names` (e.g. "sync.outer.momentum", "model.x")."""
    import torch

    from hpctrain.checkpoint import CheckpointManager
    from hpctrain.checkpoint.safe_load import read_metadata

    md = read_metadata(Path(ckpt) / ".metadata").state_dict_metadata
    state = {name: torch.empty(tuple(md[name].size), dtype=md[name].properties.dtype) for name in names}
    CheckpointManager(Path(ckpt).parent, keep=1, rank=0, world_size=1).load(ckpt, state)
    return state


def test_the_last_partial_round_adds_its_work_without_a_momentum_step(tmp_path, dataset):
    """1 replica + 1 server (no timing in it), H = 4, delayed Nesterov (N = 1: every full arrival
    takes a momentum step), 10 steps: rounds end at 4 and 8 (checkpoint), then the end of training
    cuts the last round to 2 steps. That arrival applies its share alone (outer.py, `final`): the
    global model moves by the 2 steps' work, momentum and accumulator stay as at step 8. Before, it
    took the momentum step of the full rounds too (momentum changed; on 2 replicas the final
    held-out loss went from ~3.45 to up to 7.7: test_a_replica_adds_the_others_arrivals...)."""
    from torch import equal

    cfg, run = write_config(tmp_path, dataset, "partial")
    train(2, cfg, *ASYNC, "--sync.inner_steps=4", "--train.steps=10", "--checkpoint.interval=8",
          "--checkpoint.keep=2", "--train.eval_interval=0")
    assert [rec["local_steps"] for rec in records(run) if "arrival" in rec] == [4, 4, 2]
    names = ["sync.outer.momentum", "sync.outer.acc", "model.tok_emb.weight"]
    at = {step: checkpoint_tensors(run / "checkpoints" / f"step_{step:08d}", names) for step in (8, 10)}
    assert at[8]["sync.outer.momentum"].abs().max() > 0  # full rounds took momentum steps
    assert equal(at[8]["sync.outer.momentum"], at[10]["sync.outer.momentum"])
    assert equal(at[8]["sync.outer.acc"], at[10]["sync.outer.acc"])
    assert not equal(at[8]["model.tok_emb.weight"], at[10]["model.tok_emb.weight"])  # the work is in

def test_usr1_to_one_replica_stops_every_rank_then_resumes(tmp_path, two_plays):
    """USR1 to replica 1 only: both replicas and the server stop at one step with a checkpoint
    (exit 75 on every rank); the same command finishes the run with every batch trained once."""
    run = tmp_path / "async"
    (tmp_path / "async.toml").write_text(PREEMPT_GPT.format(run=run, data=two_plays))
    code, err = signal_rank_midrun(3, tmp_path / "async.toml", run, 1, *ASYNC, "--sync.inner_steps=4")
    assert code == 75, err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("stopping at step")]
    assert len(stops) == 1 and "Traceback" not in err, err[-3000:]
    s = int(stops[0].split()[3].rstrip(":"))
    assert f"checkpoint: step {s} -> " in err
    done = [rec["step"] for r in (0, 1) for rec in records(run, r) if "loss" in rec]
    assert sorted(done) == list(range(1, s + 1))
    r = train(3, tmp_path / "async.toml", *ASYNC, "--sync.inner_steps=4")
    assert f"at step {s}" in r.stderr
    done = [rec["step"] for r in (0, 1) for rec in records(run, r) if "loss" in rec]
    total = int(PREEMPT_GPT.split("steps = ")[1].split()[0])
    assert sorted(done) == list(range(1, total + 1)), sorted(done)


def test_a_lost_replica_ends_the_job_with_its_name_and_an_intact_checkpoint(tmp_path, dataset):
    """Replica 1 of 2 is SIGKILLed mid-run (mpiexec told not to clean up, as srun without
    --kill-on-bad-exit): the other replica and the server exit non-zero within the heartbeat
    bound, naming it, and the newest checkpoint verifies intact."""
    import os
    import signal
    import socket
    import time

    from hpctrain.checkpoint import list_checkpoints, verify_checkpoint
    cfg, run = fault_config(tmp_path, dataset)
    proc = launch(3, cfg, *ASYNC, "--train.steps=100000", "--checkpoint.interval=8",
                  "--checkpoint.keep=2", "--dist.heartbeat_timeout_s=5", "--sync.inner_steps=4",
                  mpi_flags=["-disable-auto-cleanup"])
    t0 = time.monotonic()
    while not any(i.status == "committed" for i in list_checkpoints(run / "checkpoints", full=True)):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() - t0 < 120, "no checkpoint written"
        time.sleep(0.2)
    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    t_fault = time.monotonic()
    rc, out = finish(proc, timeout=60)
    assert rc != 0 and time.monotonic() - t_fault < 5 + 3 * 0.5 + 3 + 5, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert all(f"rank 1 on {socket.gethostname()} lost" in e for e in errors), out[-3000:]
    assert "Traceback" not in out
    committed = [i for i in list_checkpoints(run / "checkpoints", full=True) if i.status == "committed"]
    assert committed and all(verify_checkpoint(i.path, full=True) == [] for i in committed)
