"""Async checkpoint saves in one process (a real 1-rank gloo group): the staged copy is what gets
written even though training mutates the weights meanwhile; one save in flight at a time; a write
error in the background surfaces at wait() and leaves the previous checkpoint intact.

Failures are injected with the same save_point fault (HPCTRAIN_TEST_FAULTS) the MPI kill tests use (a real
OSError(ENOSPC) raised at the file stream, below DCP); nothing mocks torch.distributed.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctrain import step_faults
from hpctrain.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint


def make(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (4, 8))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_of(model, opt):
    return dict(zip(("model", "optim"), get_state_dict(model, opt)))


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_into_fresh(mgr, path):
    model, opt = make(99)
    state = state_of(model, opt)
    extra = mgr.load(path, state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, extra


def test_async_save_writes_the_staged_copy(world, tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1, full_checksums=True)
    model, opt = make(0)
    before = snapshot(model)
    mgr.save_async(1, state_of(model, opt), {"step": 1})
    with torch.no_grad():  # training goes on while the save is written
        for p in model.parameters():
            p.add_(1.0)
    path = mgr.wait()
    assert path == tmp_path / "step_00000001"
    assert verify_checkpoint(path, full=True) == []
    loaded, extra = load_into_fresh(mgr, path)
    assert extra == {"step": 1}
    for k, v in snapshot(loaded).items():
        assert torch.equal(v, before[k]), k
    assert mgr.wait() is None  # nothing in flight any more


def test_one_save_in_flight_and_sync_save_waits(world, tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3, rank=0, world_size=1)
    model, opt = make(0)
    mgr.save_async(1, state_of(model, opt), {"step": 1})
    mgr.save_async(2, state_of(model, opt), {"step": 2})  # waits for step 1 first
    assert verify_checkpoint(tmp_path / "step_00000001") == []
    mgr.save(3, state_of(model, opt), {"step": 3})        # finishes step 2 first
    assert mgr.poll()
    assert [verify_checkpoint(tmp_path / f"step_0000000{s}") for s in (1, 2, 3)] == [[], [], []]
    assert mgr.latest() == tmp_path / "step_00000003"


def test_background_write_error_surfaces_at_wait(world, tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    model, opt = make(0)
    mgr.save(1, state_of(model, opt), {"step": 1})
    monkeypatch.setenv(step_faults.ENV, "save_point=write:__0_0.distcp:1:0:enospc")
    mgr.save_async(2, state_of(model, opt), {"step": 2})  # returns: the write fails later
    with pytest.raises(CheckpointError) as e:
        mgr.wait()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint save to {tmp_path / 'step_00000002'} failed: ")
    assert "No space left on device" in msg and "step_00000002.tmp/__0_0.distcp" in msg
    assert not (tmp_path / "step_00000002.tmp").exists()
    assert mgr.latest() == tmp_path / "step_00000001"
    assert verify_checkpoint(tmp_path / "step_00000001") == []
    monkeypatch.delenv(step_faults.ENV)
    mgr.save_async(2, state_of(model, opt), {"step": 2})  # the manager is usable again
    assert mgr.wait() == tmp_path / "step_00000002"


def test_fault_spec_is_validated(monkeypatch):
    from hpctrain.checkpoint import faults
    from hpctrain.errors import ConfigError

    for spec, named in (("no.such.point", "unknown fault point 'no.such.point'"),
                        ("save.begin:1::explode", "kill, enospc, stop or sleep"),
                        ("save.begin:1::sleep", "SECONDS"), ("save.begin:1::sleep:x", "SECONDS"),
                        ("save.begin:two", "COUNT and RANK")):
        monkeypatch.setenv(step_faults.ENV, f"save_point={spec}")
        with pytest.raises(ConfigError, match=f"HPCTRAIN_TEST_FAULTS: save_point={spec}: .*{named}"):
            faults.hit("save.begin")
    monkeypatch.setenv(step_faults.ENV, "save_point=save.begin:2")  # armed for the 2nd time only
    faults.hit("save.begin")
    monkeypatch.setenv(step_faults.ENV, "save_point=save.begin:1::enospc")
    with pytest.raises(OSError, match="No space left"):
        faults.hit("save.begin")
    monkeypatch.setenv(step_faults.ENV, "save_point=load.begin:1::sleep:0.2")  # a slow reader
    t0 = time.monotonic()
    faults.hit("load.begin")
    assert time.monotonic() - t0 >= 0.2


class FakeClock:
    """Time that advances only when the writer 'works' (busy) or the pacer sleeps."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5, 1.0])
def test_pacer_keeps_the_writer_busy_for_its_share_of_the_wall_time(share):
    from hpctrain.checkpoint.background import Pacer

    clock = FakeClock()
    pacer = Pacer(share, clock=clock, sleep=clock.sleep)
    busy = 0.0
    for chunk in [0.004, 0.010, 0.0005, 0.0005, 0.0005, 0.0005, 0.020, 0.003] * 5:
        clock.now += chunk  # the writer works on a chunk, then reports it
        busy += chunk
        pacer.pace()
    assert busy / clock.now == pytest.approx(share, rel=1e-9)
    assert all(s > 0 for s in clock.slept) and (share < 1.0) == bool(clock.slept)
    # bursts shorter than MIN_BUSY_S accumulate into one sleep instead of many tiny ones
    assert len(clock.slept) <= (5 * 6 if share < 1.0 else 0)


def test_full_speed_stops_the_sleeps():
    from hpctrain.checkpoint.background import Pacer

    clock = FakeClock()
    pacer = Pacer(0.1, clock=clock, sleep=clock.sleep)
    clock.now += 0.01
    pacer.pace()
    assert clock.slept == [pytest.approx(0.09)]
    pacer.full_speed()
    for _ in range(10):
        clock.now += 0.01
        pacer.pace()
    assert len(clock.slept) == 1


def test_a_heavily_paced_save_still_finishes_promptly_at_wait(world, tmp_path):
    """share=0.001 would stretch the write ~1000x; wait() (exit, a stop, the next save) lifts the
    limit, so the checkpoint is complete and committed when wait() returns."""
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1, async_cpu_share=0.001)
    model, opt = make(0)
    before = snapshot(model)
    mgr.save_async(1, state_of(model, opt), {"step": 1})
    assert mgr.wait() == tmp_path / "step_00000001"
    assert verify_checkpoint(tmp_path / "step_00000001") == []
    loaded, _ = load_into_fresh(mgr, tmp_path / "step_00000001")
    assert all(torch.equal(v, before[k]) for k, v in snapshot(loaded).items())


def test_full_speed_cuts_a_long_sleep_short():
    import threading
    import time

    from hpctrain.checkpoint.background import Pacer

    pacer = Pacer(1e-6)  # real clock and sleep: 20 ms of work would earn a ~6 hour sleep
    time.sleep(0.02)
    writer = threading.Thread(target=pacer.pace)
    writer.start()
    writer.join(0.2)
    assert writer.is_alive()  # sleeping
    pacer.full_speed()
    writer.join(30)
    assert not writer.is_alive()


def test_staged_dtensor_stays_in_host_memory(world, monkeypatch):
    """A DTensor shard staged for an async save keeps the host buffer as its local tensor, whatever
    the mesh's device (from_local moved it back onto the mesh's device: under FSDP/TP on GPUs one
    more copy of the shard in GPU memory). The mesh here claims device type 'meta' to show a move."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hpctrain.checkpoint import background

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    monkeypatch.setattr(type(mesh), "device_type", property(lambda self: "meta"))
    buffers = {}
    staged = background.stage({"w": dt}, buffers)["w"]
    assert isinstance(staged, DTensor) and staged.shape == dt.shape
    assert staged.to_local().device.type == "cpu"
    assert staged.to_local().data_ptr() == buffers[".w"].data_ptr()
    assert torch.equal(staged.to_local(), dt.to_local())
