"""A mixture-of-experts layer adds in a fixed order on every device (#49 defect 3): its forward and
backward run no floating-point scatter that adds several values into one element (index_add_,
index_put_ / put_ with accumulate, scatter_add, scatter_reduce "sum"), which CUDA computes with
atomics in whatever order its threads arrive: recorded op by op under a TorchDispatchMode while a
layer with top-3 routing (3 rows per token), shared experts and skewed routing runs forward and
backward, plain and as parallel.deterministic_experts runs it on one rank. And on a CPU the layer's
outputs and every gradient are bit-identical to the index_add_ form it replaces (fp32 and bf16,
top-1 to top-4)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_

aten = torch.ops.aten
DIM, HIDDEN, TOKENS = 16, 24, 96


class AddsIntoOneElement(TorchDispatchMode):
    """Records every floating-point scatter op whose destinations repeat: an element that
    receives several adds (on CUDA, atomics in a run-dependent order)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.scatters = 0  # accumulating scatters seen, repeated destinations or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = _accumulated_index(func, args, kwargs)
        if index is not None and args[0].is_floating_point():
            self.scatters += 1
            if index():
                self.found.append(str(func))
        return func(*args, **kwargs)


def _accumulated_index(func, args, kwargs):
    """None, or a function telling whether this accumulating op's destinations repeat."""
    packet = func.overloadpacket
    if packet in (aten.index_add, aten.index_add_):
        return lambda: _repeats(args[2])
    if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        return (lambda: _repeats_together([i for i in args[1] if i is not None])) if accumulate else None
    if packet in (aten.put, aten.put_):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        return (lambda: _repeats(args[1])) if accumulate else None
    if packet in (aten.scatter_add, aten.scatter_add_):
        return lambda: _repeats_along(args[2], args[1])
    if packet in (aten.scatter_reduce, aten.scatter_reduce_) and args[4] in ("sum", "mean"):
        return lambda: _repeats_along(args[2], args[1])
    return None


def _repeats(index: torch.Tensor) -> bool:
    return index.dtype != torch.bool and index.unique().numel() < index.numel()


def _repeats_together(indices: list[torch.Tensor]) -> bool:
    if len(indices) == 1:
        return _repeats(indices[0])
    coords = torch.stack(torch.broadcast_tensors(*indices), -1).reshape(-1, len(indices))
    return coords.unique(dim=0).shape[0] < coords.shape[0]


def _repeats_along(index: torch.Tensor, dim: int) -> bool:
    """scatter's destination of index[..., j, ...] is (its other coordinates, index value)."""
    return bool(index.sort(dim).values.diff(dim=dim).eq(0).any())


def _moe(dtype=torch.float32, **cfg) -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(DIM, HIDDEN, MoEConfig(**cfg)).to(dtype)
    init_moe_(moe, 0.3, 0.3)
    with torch.no_grad():
        moe.router.weight[0] += 0.5  # expert 0 favoured by the tokens' positive mean
    return moe


def _forward_backward(moe: MoEFeedForward, x: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = moe(x)
    (out.float() * weights).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in moe.parameters() if p.grad is not None]


@pytest.fixture
def one_rank_group():
    """A one-rank process group (torch's fake backend: no collective runs with ep = 1), removed
    after the test so that no other test in this process sees torch.distributed initialized."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["plain", "deterministic_experts"])
def test_no_scatter_adds_twice_into_an_element(layout, request):
    """deterministic_experts: the layer as apply_expert.py runs it with ep = 1, its experts
    through ExpertParallelExperts on a one-rank group, gradients kept per source."""
    from hpctrain.parallel.expert import shard_experts

    moe = _moe(n_experts=8, top_k=3, n_shared_experts=1, aux_loss_coef=0.01).train()
    if layout == "deterministic_experts":
        group = request.getfixturevalue("one_rank_group")
        moe.experts = shard_experts(moe.experts, 8, group, per_source_grads=True)
    x = torch.randn(TOKENS, DIM) + 0.5
    mode = AddsIntoOneElement()
    with mode:
        grads = _forward_backward(moe, x, torch.randn(TOKENS, DIM))
    assert mode.found == [], mode.found
    assert int(moe.take_load().sum()) == TOKENS * 3  # every routed row
    assert mode.scatters >= 1  # the mode saw the step's scatters (the router's gather backward)
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def test_the_recorder_sees_index_add_and_the_backward_of_x_rows():
    """The check can fail: the form #49 replaced (index_add_ combine, x[rows] dispatch) is caught."""
    x = torch.randn(6, 4, requires_grad=True)
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    mode = AddsIntoOneElement()
    with mode:
        y = torch.zeros(3, 4).index_add_(0, rows, x[rows])
        y.sum().backward()
    assert mode.found == ["aten.index_add_.default", "aten.index_put.default"], mode.found


def _index_add_forward(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """MoEFeedForward.forward before #49: x[rows] in, index_add_ out (the CPU numbers to keep)."""
    gates, ids, _ = moe.router(x)
    order = ids.reshape(-1).argsort(stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=moe.cfg.n_experts)
    out_sorted = moe.experts(x[order // moe.cfg.top_k], counts)
    weighted = out_sorted * gates.reshape(-1)[order, None]
    out = torch.zeros_like(x).index_add_(0, order // moe.cfg.top_k, weighted.to(x.dtype))
    return out + moe.shared(x, [x.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_cpu_numbers_bit_identical_to_index_add(dtype, top_k):
    moe = _moe(dtype, n_experts=6, top_k=top_k, n_shared_experts=1).train()
    old = copy.deepcopy(moe)
    old.forward = lambda x: _index_add_forward(old, x)
    x, weights = (torch.randn(TOKENS, DIM) + 0.5).to(dtype), torch.randn(TOKENS, DIM)
    new_numbers, old_numbers = _forward_backward(moe, x, weights), _forward_backward(old, x, weights)
    assert len(new_numbers) == len(old_numbers) == 9
    for a, b in zip(new_numbers, old_numbers):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("device, asked, on", [("cuda", True, True), ("cpu", True, False),
                                               ("cuda", False, False)])
def test_deterministic_experts_turn_on_torchs_deterministic_algorithms_on_cuda_only(device, asked, on, monkeypatch):
    """The rest of a CUDA step (attention's backward) adds in one order only in torch's
    deterministic mode: parallel.deterministic_experts sets it there, with cuBLAS's workspace."""
    from hpctrain.train.precision import apply_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        assert apply_deterministic(torch.device(device), asked) is on
        assert torch.are_deterministic_algorithms_enabled() is on
        assert ("CUBLAS_WORKSPACE_CONFIG" in __import__("os").environ) is on
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
