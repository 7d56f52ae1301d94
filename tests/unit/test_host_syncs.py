"""The host-sync counter (hpctrain/metrics/host_syncs.py): each kind of op that makes the host wait
for a GPU is counted on a CPU run, once, at the hpctrain line that issued it; ops that keep values
on the device are not counted."""
import json

import pytest
import torch

from hpctrain.metrics.host_syncs import HostSyncCounter, StepSyncLog

x = torch.arange(6, dtype=torch.float32) - 2.5
mask = x > 0


@pytest.mark.parametrize("name, fn, op", [
    ("item", lambda: x[0].item(), "aten::_local_scalar_dense"),
    ("float", lambda: float(x[1]), "aten::_local_scalar_dense"),
    ("bool", lambda: bool(mask[0]), "aten::_local_scalar_dense"),
    ("if", lambda: 1 if x.sum() > 0 else 0, "aten::_local_scalar_dense"),
    ("tolist", lambda: x.tolist(), "Tensor.tolist"),
    ("cpu", lambda: x.cpu(), "Tensor.cpu"),
    ("bool mask index", lambda: x[mask], "aten::index"),
    ("bool mask assign", lambda: x.clone().__setitem__(mask, 0.0), "aten::index_put_"),
    ("masked_select", lambda: x.masked_select(mask), "aten::masked_select"),
    ("nonzero", lambda: mask.nonzero(), "aten::nonzero"),
    ("where1", lambda: torch.where(mask), "aten::nonzero"),
    ("unique", lambda: torch.unique(x), "aten::_unique2"),
    ("repeat_interleave", lambda: torch.repeat_interleave(torch.tensor([1, 2])), "aten::repeat_interleave"),
])
def test_each_sync_is_counted_once_with_its_op(name, fn, op):
    with HostSyncCounter() as counter:
        fn()
    assert counter.total == 1, counter.counts
    (key,) = counter.counts
    assert key.startswith(f"{op} @ ")
    assert key.split(" @ ")[1].split(":")[0].endswith("test_host_syncs.py")  # the caller's line


@pytest.mark.parametrize("name, fn", [
    ("arithmetic", lambda: (x * 2 + 1).sum()),
    ("masked arithmetic", lambda: torch.where(mask, x, 0.0).sum()),
    ("scatter", lambda: torch.zeros(2, 3).scatter_(1, torch.zeros(2, 1, dtype=torch.long), 1.0)),
    ("gather", lambda: x.view(2, 3).gather(1, torch.zeros(2, 1, dtype=torch.long))),
    ("long index", lambda: x[torch.tensor([0, 2])]),
    ("repeat_interleave int", lambda: x.repeat_interleave(2)),
    ("repeat_interleave sized", lambda: torch.repeat_interleave(x, torch.tensor([1] * 6), output_size=6)),
    ("numpy", lambda: x.numpy()),  # host buffers only: on a GPU tensor it raises
    ("to dtype", lambda: x.to(torch.float64)),
])
def test_device_side_ops_are_not_counted(name, fn):
    with HostSyncCounter() as counter:
        fn()
    assert counter.total == 0, counter.counts


def test_hpctrain_frame_names_the_culprit():
    """Inside hpctrain the innermost hpctrain frame is named (not torch's, not the test's)."""
    from hpctrain.train.bad_steps import all_finite

    with HostSyncCounter() as counter:
        all_finite([torch.ones(3), torch.ones(2)], torch.device("cpu"))
    assert counter.total >= 1
    assert all(key.split(" @ ")[1].startswith("hpctrain/train/bad_steps.py:") for key in counter.counts)


def test_step_log_writes_per_step_counts(tmp_path):
    log = StepSyncLog(tmp_path, rank=3)
    for step in (1, 2):
        with log.count(step):
            for _ in range(step):
                x.sum().item()
    with log.count(3):
        x.sum()
    log.write()
    data = json.loads((tmp_path / "host_syncs.rank3.json").read_text())
    assert data["rank"] == 3
    assert [sum(data["steps"][s].values()) for s in ("1", "2", "3")] == [1, 2, 0]


def test_device_mesh_rank_grid_is_host_memory_by_design():
    """DeviceMesh keeps its rank grid on the host on every device: its look-ups are not syncs."""
    import torch.distributed.device_mesh as dm

    grid = torch.arange(4).view(2, 2)
    code = compile("(grid == 3).nonzero().tolist()", dm.__file__, "eval")  # as if in device_mesh.py
    with HostSyncCounter() as counter:
        eval(code, {"grid": grid})
    assert counter.total == 0, counter.counts


def test_all_finite_reads_the_host_once_for_any_number_of_parameters():
    """Checkpoint saving's finite check: one batched read, not one per parameter (was 1 per
    parameter + 1: 9 here)."""
    from hpctrain.train.bad_steps import all_finite

    params = [torch.ones(3) for _ in range(8)]
    with HostSyncCounter() as counter:
        assert all_finite(params, torch.device("cpu"))
    assert counter.total == 1, counter.counts
    params[5][1] = float("nan")
    assert not all_finite(params, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_has_no_host_sync(dtype):
    """train.loss_chunk's eager path (the only one under TP): no boolean-mask indexing (was 2
    syncs per chunk: 8 here), and still F.cross_entropy's loss and gradients, ignored targets too."""
    from hpctrain.parallel.loss import IGNORE_INDEX, chunked_lm_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 8), generator=g)
    targets[0, 3] = targets[1, 7] = IGNORE_INDEX
    with HostSyncCounter() as counter, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = chunked_lm_loss(h, w, targets, chunk=4)
        loss.backward()
    assert counter.total == 0, counter.counts
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = h2 @ w2.t()
    ref = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - ref.item()) < tol
    assert torch.allclose(h.grad, h2.grad, atol=tol) and torch.allclose(w.grad, w2.grad, atol=tol)
