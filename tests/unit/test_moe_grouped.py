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
