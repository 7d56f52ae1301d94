"""The mixture-of-experts feed-forward (hpctrain/model/moe.py, #34): dropless routing against a
per-token reference under deliberately unbalanced routing, transformers' Mixtral block with the
same weights, the auxiliary loss's gradient, the auxiliary-loss-free balancing bias, and load
counted once under activation checkpointing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_, load_balancing_loss

DIM, HIDDEN, TOKENS = 16, 24, 96


def _moe(seed=0, skew=0.0, **cfg) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(DIM, HIDDEN, MoEConfig(**cfg))
    init_moe_(moe, 0.3, 0.3)
    with torch.no_grad():  # with _tokens' positive mean, expert 0 is favoured: unbalanced routing
        moe.router.weight[0] += skew
    return moe


def _tokens(*shape) -> torch.Tensor:
    return torch.randn(*shape, DIM) + 0.5


def _reference(moe: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: the gates of its top-k experts times each expert's SwiGLU (+ shared)."""
    cfg, e = moe.cfg, moe.experts
    out, chosen = torch.zeros_like(x), []
    for t in range(x.shape[0]):
        logits = moe.router.weight @ x[t]
        scores = logits.softmax(-1) if cfg.gate == "softmax" else logits.sigmoid()
        ids = (scores + moe.router.bias).topk(cfg.top_k).indices if cfg.bias_update_rate else scores.topk(cfg.top_k).indices
        gates = scores[ids] / (scores[ids].sum() if cfg.norm_topk_prob else 1.0)
        for g, i in zip(gates, ids):
            out[t] += g * (e.w2[i] @ (F.silu(e.w1[i] @ x[t]) * (e.w3[i] @ x[t])))
        if moe.shared is not None:
            s = moe.shared
            gate = torch.sigmoid(moe.shared_gate.weight[0] @ x[t]) if moe.shared_gate is not None else 1.0
            out[t] += gate * (s.w2[0] @ (F.silu(s.w1[0] @ x[t]) * (s.w3[0] @ x[t])))
        chosen.append(ids)
    return out, torch.bincount(torch.cat(chosen), minlength=cfg.n_experts)


@pytest.mark.parametrize("cfg", [dict(n_experts=4, top_k=2), dict(n_experts=6, top_k=1),
                                 dict(n_experts=4, top_k=2, n_shared_experts=1),
                                 dict(n_experts=4, top_k=2, n_shared_experts=1, shared_hidden=40,
                                      shared_gate=True, norm_topk_prob=False),
                                 dict(n_experts=8, top_k=3, gate="sigmoid", bias_update_rate=0.01)])
def test_dropless_equals_the_per_token_reference_under_skewed_routing(cfg):
    moe = _moe(skew=2.0, **cfg)
    if cfg.get("bias_update_rate"):
        with torch.no_grad():
            moe.router.bias.copy_(torch.linspace(-0.2, 0.3, cfg["n_experts"]))
    x = _tokens(2, TOKENS // 2)
    with torch.no_grad():
        out = moe(x)
        ref, ref_load = _reference(moe, x.reshape(-1, DIM))
    torch.testing.assert_close(out.reshape(-1, DIM), ref, rtol=1e-5, atol=1e-5)
    load = moe.take_load()
    assert load.tolist() == ref_load.tolist() and int(load.sum()) == TOKENS * cfg["top_k"]
    assert int(load.max()) > 1.5 * TOKENS * cfg["top_k"] / cfg["n_experts"]  # really unbalanced
    assert int(moe.take_load().sum()) == 0  # read once


def test_matches_transformers_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=DIM, intermediate_size=HIDDEN,
                                             num_local_experts=4, num_experts_per_tok=2)).eval()
    moe = _moe(n_experts=4, top_k=2).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        hf.experts.down_proj.copy_(moe.experts.w2)
        x = torch.randn(3, 20, DIM)
        assert (hf(x) - moe(x)).abs().max() <= 1e-5


def test_matches_transformers_qwen2_moe_block():
    """Qwen2-MoE: softmax top-k without renormalization, a gated shared expert of its own width."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
        hidden_size=DIM, moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)).eval()
    moe = _moe(n_experts=4, top_k=2, n_shared_experts=1, shared_hidden=40, shared_gate=True,
               norm_topk_prob=False).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        hf.experts.down_proj.copy_(moe.experts.w2)
        hf.shared_expert.gate_proj.weight.copy_(moe.shared.w1[0])
        hf.shared_expert.up_proj.weight.copy_(moe.shared.w3[0])
        hf.shared_expert.down_proj.weight.copy_(moe.shared.w2[0])
        hf.shared_expert_gate.weight.copy_(moe.shared_gate.weight)
        x = torch.randn(3, 20, DIM)
        assert (hf(x) - moe(x)).abs().max() <= 1e-5


def test_aux_loss_gradient_reaches_the_router_scaled():
    """The auxiliary loss enters the gradient inside the layer: a backward of 0 x output gives the
    router exactly d(coef x scale x aux)/dW."""
    moe = _moe(skew=1.0, n_experts=4, top_k=2, aux_loss_coef=0.01)
    moe.aux_scale = 0.5  # e.g. grad_accum 2
    x = _tokens(TOKENS)
    (moe(x) * 0).sum().backward()
    got = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    scores = F.linear(x, moe.router.weight).softmax(-1)
    counts = torch.bincount(scores.topk(2).indices.reshape(-1), minlength=4)
    (0.01 * 0.5 * load_balancing_loss(scores, counts, 2)).backward()
    torch.testing.assert_close(got, moe.router.weight.grad)
    assert float(moe.last_aux_loss) > 1.0  # above 1: unbalanced
    uniform = load_balancing_loss(torch.full((8, 4), 0.25), torch.tensor([4, 4, 4, 4]), 2)
    assert float(uniform) == pytest.approx(1.0)


@pytest.mark.parametrize("rate,balanced", [(0.02, True), (0.0, False)])
def test_bias_balancing_evens_a_skewed_start(rate, balanced):
    """DeepSeek-V3's bias step: max/mean load of a skewed router falls below 1.3 within 150 steps
    with it; without it the bias stays 0, so the router never changes: 10 steps show the load
    staying unbalanced (the same draws as steps 141-150 would be)."""
    moe = _moe(skew=0.5, n_experts=8, top_k=2, gate="sigmoid", bias_update_rate=rate)
    torch.manual_seed(1)
    ratios = []
    with torch.no_grad():
        for _ in range(150 if balanced else 10):
            moe(_tokens(8 * TOKENS))
            load = moe.take_load()
            ratios.append(float(load.max()) / float(load.float().mean()))
            moe.update_balance_bias(load)
    assert ratios[0] > 2.0
    assert (max(ratios[-10:]) < 1.3) is balanced, ratios[-10:]
    assert bool(moe.router.bias.eq(0).all()) is not balanced


def test_load_counted_once_under_activation_checkpointing():
    moe = _moe(n_experts=4, top_k=2).train()
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert int(moe.take_load().sum()) == TOKENS * 2
    assert x.grad is not None and moe.experts.w1.grad is not None


def test_llama_with_sparse_layers_counts_active_parameters():
    """moe_every 2: layers 1 and 3 sparse; the MFU's N counts top_k of n_experts routed experts."""
    from hpctrain.model.llama import Llama, LlamaConfig

    cfg = LlamaConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=300, n_kv_head=2,
                      multiple_of=32, moe=MoEConfig(n_experts=4, top_k=1, n_shared_experts=1),
                      moe_every=2)
    torch.manual_seed(0)
    model = Llama(cfg)
    sparse = [i for i, b in model.blocks.items() if isinstance(b.mlp, MoEFeedForward)]
    assert sparse == ["1", "3"]
    routed = sum(p.numel() for i in sparse for p in model.blocks[i].mlp.experts.parameters())
    assert model.num_params() - model.active_params() == routed * 3 // 4
    model(torch.randint(0, 300, (2, 32))).float().mean().backward()
    assert model.blocks["1"].mlp.router.weight.grad is not None
    assert model.blocks["1"].mlp.router.bias.grad is None  # the balancing bias is never trained
    # residual projections start small, like the dense blocks' mlp.proj
    assert float(model.blocks["1"].mlp.experts.w2.std()) < 0.5 * float(model.blocks["1"].mlp.experts.w1.std())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_matmul_equals_the_loop_over_experts(dtype, tol, monkeypatch):
    """The experts' grouped matmul (torch._grouped_mm) computes what one matmul per expert does,
    forward and backward, an expert with no rows included (its gradient is zero)."""
    from hpctrain.model import moe

    torch.manual_seed(3)
    experts = moe.Experts(4, 16, 24).to(dtype)
    with torch.no_grad():
        for w in (experts.w1, experts.w3, experts.w2):
            w.normal_(0, 0.2)
    counts = [5, 0, 7, 3]
    x = torch.randn(sum(counts), 16, dtype=dtype)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(grouped: bool):
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *t: grouped)
        xi = x.clone().requires_grad_(True)
        out = experts(xi, counts)
        grads = torch.autograd.grad(out.float().square().sum(), (xi, experts.w1, experts.w3, experts.w2))
        return out.float(), [g.float() for g in grads]

    loop_out, loop_grads = run(False)
    assert not calls
    out, grads = run(True)
    assert len(calls) == 3  # gate, up, down: one call each, no loop
    assert (out - loop_out).abs().max() <= tol * loop_out.abs().max()
    for g, ref in zip(grads, loop_grads):
        assert (g - ref).abs().max() <= tol * ref.abs().max()
    assert grads[1][1].abs().max() == 0  # expert 1 saw no rows
    monkeypatch.undo()
    assert moe._grouped_mm_fits(x, experts.w1) == (dtype in (torch.float32, torch.bfloat16))
    assert not moe._grouped_mm_fits(x.double(), experts.w1)  # fp64: the loop
