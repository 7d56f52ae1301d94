"""The run plan (resolved once, frozen; the user's Config never written) and the loop's hook registry."""
import dataclasses
import types

import pytest
import torch

from hpctrain import config
from hpctrain.distributed.mesh import ParallelDims
from hpctrain.train import run_plan
from hpctrain.train.hooks import POINTS, LoopHooks
from tests.conftest import TINY_TRAIN

def load(tmp_path, *overrides):
    p = tmp_path / "c.toml"
    p.write_text(TINY_TRAIN.format(run=tmp_path / "run", data=tmp_path / "data", steps=10))
    return config.load(p, ["--train.micro_batch_size=4", *overrides])


def ranks(dp_size: int):
    """This rank's context and mesh as the plan reads them: the device, the world, dp."""
    ctx = types.SimpleNamespace(device=torch.device("cpu"), world_size=dp_size, rank=0)
    return ctx, types.SimpleNamespace(dp_rank=0, dp_size=dp_size, dims=ParallelDims.from_world(dp_size))


def test_plan_resolves_grad_accum_and_precision_and_leaves_the_config_as_given(tmp_path):
    cfg = load(tmp_path, "--train.global_batch=24", "--train.precision=bf16", "--train.stop_at_step=6")
    given = cfg.to_dict()
    plan = run_plan.resolve(cfg, *ranks(2))
    assert (plan.grad_accum, plan.dp_size, plan.world_size, plan.end_step) == (3, 2, 2, 6)
    assert (plan.precision, plan.precision_given) == ("bf16", "bf16")
    assert cfg.to_dict() == given and cfg.train.grad_accum == 1  # never written
    # what a checkpoint's "trainer" entry records: the resolved values, as before the plan
    assert plan.resolved_config(cfg).train.grad_accum == 3 and cfg.train.grad_accum == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp_size = 4
    # an elastic restart on 3 replicas: the same global batch
    assert run_plan.resolve(cfg, *ranks(3)).grad_accum == 2


def test_plan_holds_the_armed_step_faults(tmp_path, monkeypatch):
    cfg = load(tmp_path)
    assert run_plan.resolve(cfg, *ranks(1)).faults.delay_rank == -1  # unset: every fault off
    monkeypatch.setenv("HPCTRAIN_TEST_FAULTS", "delay_rank=1,delay_s=0.25")
    faults = run_plan.resolve(cfg, *ranks(1)).faults
    assert (faults.delay_rank, faults.delay_s) == (1, 0.25)


def test_hooks_run_in_order_and_boundaries_shorten_a_span():
    hooks, calls = LoopHooks(), []
    hooks.add("at_meeting", lambda: calls.append("first"))
    hooks.add("at_meeting", lambda: calls.append("second"))
    hooks.add("after_step", lambda rec: rec.update(extra=1))
    hooks.run("at_meeting")
    rec = {"step": 1}
    hooks.run("after_step", rec)
    assert calls == ["first", "second"] and rec == {"step": 1, "extra": 1}
    assert hooks.next_boundary(5, 10) == 10  # no boundary hook: the checkpoint step
    hooks.add_boundary(lambda step: (step // 4 + 1) * 4)
    assert (hooks.next_boundary(5, 10), hooks.next_boundary(9, 10)) == (8, 10)


def test_an_unknown_hook_point_is_refused_naming_the_points():
    with pytest.raises(ValueError) as e:
        LoopHooks().add("after_stpe", print)
    assert "after_stpe" in str(e.value) and all(p in str(e.value) for p in POINTS)
