"""Mixture of experts on a GPU: the experts' grouped matmul (CUDA bf16, every group padded to 16
rows: hpctrain/model/moe.py cuda_grouped_swiglu) against one matmul per expert (loop_swiglu), forward
and backward under bf16 autocast as training runs them, with deliberately unbalanced groups (an
empty one, a one-row one). Skipped, with the reason, where CUDA or an sm90+ GPU is not available."""
from __future__ import annotations

import pytest
import torch

from hpctrain.model.moe import Experts, _cuda_grouped_mm_fits, loop_swiglu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] < 9,
    reason="needs a CUDA GPU of compute capability 9 or newer (torch._grouped_mm's kernel)")]

COUNTS = [700, 0, 1, 2048, 33, 129, 512, 673]


def run(experts: Experts, x: torch.Tensor, grouped: bool):
    experts.zero_grad()
    xi = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert _cuda_grouped_mm_fits(xi, experts.w1)  # the grouped path is the one training takes
        out = experts(xi, COUNTS) if grouped else loop_swiglu(xi, experts.w1, experts.w3, experts.w2, COUNTS)
    out.float().pow(2).mean().backward()
    return out.float().detach(), xi.grad.float(), [w.grad.float().clone() for w in experts.parameters()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_grouped_experts_match_the_loop_forward_and_backward_in_bf16():
    torch.manual_seed(0)
    experts = Experts(len(COUNTS), 512, 1408).cuda()
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    x = torch.randn(sum(COUNTS), 512, device="cuda")
    grouped, loop = run(experts, x, True), run(experts, x, False)
    assert grouped[0].shape == (sum(COUNTS), 512)
    assert rel(grouped[0], loop[0]) < 2e-2 and rel(grouped[1], loop[1]) < 2e-2, (rel(grouped[0], loop[0]), rel(grouped[1], loop[1]))
    for g, ref in zip(grouped[2], loop[2]):
        assert rel(g, ref) < 2e-2, rel(g, ref)
    assert grouped[2][0][1].abs().sum().item() == 0  # the 0-row expert: no gradient


def test_a_moe_layer_forward_and_backward_repeat_bit_for_bit():
    """#49 defect 3: a token's k expert rows are added without atomics (hpctrain/model/moe_rows.py;
    index_add_ and the backward of x[rows] used CUDA atomics, in a run-dependent order): top-4
    of 8 experts, skewed routing, shared experts, bf16 autocast, 4096 tokens, run twice: the
    outputs and every gradient bit-equal."""
    from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_

    torch.manual_seed(0)
    moe = MoEFeedForward(512, 1408, MoEConfig(n_experts=8, top_k=4, n_shared_experts=1,
                                              aux_loss_coef=0.01)).cuda().train()
    init_moe_(moe, 0.02, 0.02)
    with torch.no_grad():
        moe.router.weight[0] += 0.05  # expert 0 favoured by the tokens' positive mean
    x = torch.randn(4096, 512, device="cuda") + 0.5

    def once():
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(xi)
        out.float().pow(2).mean().backward()
        return [out.detach().float(), xi.grad] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]

    first, second = once(), once()
    assert len(first) == len(second) >= 8
    assert [torch.equal(a, b) for a, b in zip(first, second)] == [True] * len(first)
