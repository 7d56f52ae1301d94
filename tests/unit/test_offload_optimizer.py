"""OffloadedAdamW (parallel.offload = "optimizer", hpctrain/parallel/optim_offload.py) on one process:
the same updates as torch's fused AdamW bit for bit, its state laid out as AdamW's (so checkpoints
load across offload modes), a skipped step leaves everything alone, and a parameter written from
outside (a checkpoint load) is picked up by the host master copy."""
import torch
import torch.nn as nn

from hpctrain.config import TrainConfig
from hpctrain.model.optim import build_optimizer
from hpctrain.parallel.optim_offload import OffloadedAdamW
from hpctrain.train.states import OptimState


def model_pair():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    b.load_state_dict(a.state_dict())
    return a, b


def train_steps(model, optimizer, steps: int, found_inf_at: int = -1):
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(5, 8)
        model(x).square().mean().backward()
        if i == found_inf_at:
            optimizer.found_inf = torch.ones(())
        optimizer.step()
        if hasattr(optimizer, "found_inf"):
            del optimizer.found_inf
        optimizer.zero_grad(set_to_none=True)


T = TrainConfig(steps=10, micro_batch_size=1, lr=1e-2, weight_decay=0.1)


def test_same_updates_and_state_layout_as_fused_adamw():
    a, b = model_pair()
    plain, offloaded = build_optimizer(a, T), build_optimizer(b, T, adamw=OffloadedAdamW)
    assert isinstance(offloaded, OffloadedAdamW) and not isinstance(plain, OffloadedAdamW)
    train_steps(a, plain, 6, found_inf_at=3)
    train_steps(b, offloaded, 6, found_inf_at=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = plain.state[pa], offloaded.state[pb]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(sb["step"]) == 5.0  # 6 steps, one skipped
        for k in sa:
            assert torch.equal(sa[k], sb[k]) and sb[k].device.type == "cpu" and sb[k].dtype == sa[k].dtype
    # a checkpoint's entries (train/states.py) of one load into the other; training goes on equally
    a2, b2 = model_pair()
    p2, o2 = build_optimizer(a2, T), build_optimizer(b2, T, adamw=OffloadedAdamW)
    saved_plain, saved_offloaded = (  # copies, as a checkpoint's (state_dict() returns the live tensors)
        {k: v.clone() for k, v in OptimState(m, o).state_dict().items()}
        for m, o in ((a, plain), (b, offloaded)))
    assert saved_plain.keys() == saved_offloaded.keys()
    a2.load_state_dict(b.state_dict()), b2.load_state_dict(a.state_dict())
    OptimState(a2, p2).load_state_dict(saved_offloaded), OptimState(b2, o2).load_state_dict(saved_plain)
    train_steps(a, plain, 3), train_steps(a2, p2, 3), train_steps(b2, o2, 3)
    for pa, pa2, pb2 in zip(a.parameters(), a2.parameters(), b2.parameters()):
        assert torch.equal(pa, pa2) and torch.equal(pa, pb2)


def test_master_copy_follows_a_checkpoint_load_through_aliases():
    """DCP writes FSDP2's shards in place through aliases that leave the version counter alone
    (as p.data does here); the optimizer's own load then marks every master stale."""
    a, b = model_pair()
    plain, offloaded = build_optimizer(a, T), build_optimizer(b, T, adamw=OffloadedAdamW)
    train_steps(a, plain, 2), train_steps(b, offloaded, 3)  # b: one step further
    saved = {k: v.clone() for k, v in OptimState(a, plain).state_dict().items()}
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.data.copy_(pa.data)  # no version bump
    OptimState(b, offloaded).load_state_dict(saved)
    train_steps(a, plain, 2), train_steps(b, offloaded, 2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_master_copy_follows_an_outside_write():
    """Weights loaded into the model after some steps (a resume): the next step starts from them,
    not from the stale host master."""
    a, b = model_pair()
    plain, offloaded = build_optimizer(a, T), build_optimizer(b, T, adamw=OffloadedAdamW)
    train_steps(b, offloaded, 2)
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.copy_(pa)  # b's weights back to a's initial ones; a's optimizer state is fresh
    offloaded.state.clear()
    train_steps(a, plain, 2), train_steps(b, offloaded, 2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
