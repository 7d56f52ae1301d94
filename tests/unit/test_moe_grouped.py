"""The padded grouped-matmul form that CUDA's kernel gets (hpctrain/model/moe.py pad_groups +
grouped_swiglu), checked here on the CPU, where torch._grouped_mm runs without padding: padding every
group to 16 rows (zero rows, gathered back) gives the unpadded result and the unpadded gradients,
groups of 0 rows and of exact multiples included. tests/gpu/test_gpu_moe.py runs the CUDA form."""
from __future__ import annotations

import pytest
import torch

from hpctrain.model.moe import Experts, grouped_swiglu, pad_groups

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")

COUNTS = [5, 0, 16, 1, 33]  # an empty group, an aligned one, odd ones


def test_pad_groups_places_each_group_at_a_multiple_of_the_alignment():
    x = torch.arange(sum(COUNTS), dtype=torch.float32)[:, None].repeat(1, 8)
    padded, ends, rows = pad_groups(x, COUNTS, 16)
    assert ends.tolist() == [16, 16, 32, 48, 96] and ends.dtype == torch.int32
    assert padded.shape == (96, 8) and torch.equal(padded[rows], x)
    assert rows[:5].tolist() == [0, 1, 2, 3, 4] and rows[5:7].tolist() == [16, 17] and rows[21].item() == 32
    keep = torch.zeros(96, dtype=torch.bool)
    keep[rows] = True
    assert torch.count_nonzero(padded[~keep]) == 0  # padding rows are zeros
    # the counts handed over on the device as well (what MoEFeedForward's CUDA path does): same layout
    padded_t, ends_t, rows_t = pad_groups(x, COUNTS, 16, torch.tensor(COUNTS, dtype=torch.int64))
    assert torch.equal(padded_t, padded) and torch.equal(ends_t, ends) and torch.equal(rows_t, rows)


def test_padded_grouped_swiglu_equals_the_unpadded_one_forward_and_backward():
    torch.manual_seed(0)
    experts = Experts(len(COUNTS), 16, 24)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(sum(COUNTS), 16)
    dense_ends = torch.tensor(COUNTS).cumsum(0).to(torch.int32)

    def run(padded_form: bool):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        if padded_form:
            padded, ends, rows = pad_groups(xi, COUNTS, 16)
            out = grouped_swiglu(padded, experts.w1, experts.w3, experts.w2, ends).index_select(0, rows)
        else:
            out = grouped_swiglu(xi, experts.w1, experts.w3, experts.w2, dense_ends)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach(), xi.grad, [w.grad.clone() for w in experts.parameters()]

    plain, padded = run(False), run(True)
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded[1], plain[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(padded[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert plain[2][0][1].abs().sum() == 0  # the 0-row expert gets no gradient


def test_every_source_in_one_grouped_matmul_equals_source_by_source():
    """Expert parallelism on CUDA without deterministic_experts (#49): the received rows of 3
    source ranks x 4 local experts (empty groups included) regrouped by expert, one grouped matmul
    per weight (`all_sources_grouped`, 3 calls), against source block by source block (9 calls):
    outputs and the gradients of the rows and of every weight equal within fp32 rounding."""
    from types import SimpleNamespace

    from hpctrain.parallel.expert import all_sources_grouped

    recv_h = [[5, 0, 16, 1], [0, 0, 7, 2], [33, 1, 0, 4]]  # [source][local expert]
    torch.manual_seed(1)
    experts = Experts(4, 16, 24)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(sum(map(sum, recv_h)), 16)
    calls = []

    def run(all_sources: bool):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        w = SimpleNamespace(w1=experts.w1, w3=experts.w3, w2=experts.w2)
        if all_sources:
            out = all_sources_grouped(xi, w, torch.tensor(recv_h), recv_h)
        else:
            blocks = xi.split([sum(r) for r in recv_h])
            out = torch.cat([Experts.forward(w, b, torch.tensor(r), r) for b, r in zip(blocks, recv_h)])
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [out.detach(), xi.grad] + [w.grad.clone() for w in experts.parameters()]

    real = torch._grouped_mm
    torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        grouped, calls_grouped = run(True), len(calls)
        per_source = run(False)
    finally:
        torch._grouped_mm = real
    assert (calls_grouped, len(calls) - calls_grouped) == (3, 9)
    assert not torch.equal(grouped[0], torch.zeros_like(grouped[0]))
    for a, b in zip(grouped, per_source):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_experts", [8, 64])
def test_the_whole_moe_layer_grouped_equals_its_loop_over_experts(n_experts, monkeypatch):
    """bench/moe_grouped.py's two paths, checked: the MoE layer (router, sort, dispatch, experts,
    gates, combine) with the experts' grouped matmul (3 torch._grouped_mm calls) against the loop
    over experts (none), forward + backward in fp32 on the CPU: the same loss and the same
    gradients of the input, the router and every expert weight (at 64 experts over 96 routed rows
    some experts get none: their gradient is zero either way)."""
    from hpctrain.model import moe

    torch.manual_seed(2)
    layer = moe.MoEFeedForward(32, 48, moe.MoEConfig(n_experts=n_experts, top_k=2))
    moe.init_moe_(layer, 0.2, 0.2)
    x = torch.randn(48, 32)
    params = [p for p in layer.parameters() if p.requires_grad]
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(grouped: bool):
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *t: grouped)
        xi = x.clone().requires_grad_()
        loss = layer(xi).square().mean()
        return loss.detach(), torch.autograd.grad(loss, [xi, *params])

    loop_loss, loop_grads = run(False)
    assert not calls
    loss, grads = run(True)
    assert len(calls) == 3
    assert torch.allclose(loss, loop_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, loop_grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    if n_experts == 64:  # experts without rows were part of it
        assert layer.load is not None and int((layer.load == 0).sum()) > 0
