"""Per-op selective activation checkpointing (hpctrain/parallel/op_checkpoint.py,
parallel.activation_checkpoint = selective_op): which ops' outputs a block keeps, that its
gradients equal those without checkpointing (with dropout too), and that the planner's per-block
bytes (hpctrain/plan/activations.py) are what the policy keeps."""
from __future__ import annotations

import copy
import collections

import pytest
import torch

from hpctrain.model.llama import Llama, LlamaConfig
from hpctrain.model.moe import MoEConfig
from hpctrain.parallel import op_checkpoint
from hpctrain.parallel.activation import apply_activation_checkpointing

aten = torch.ops.aten
LINEARS_PER_BLOCK = 7  # wq wk wv wo, gate up proj


def _llama(dropout: float = 0.0, moe: MoEConfig | None = None) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64,
                             multiple_of=16, dropout=dropout, moe=moe))


class _Kept:
    """Wraps op_checkpoint.op_policy: counts, per op, the forward outputs it keeps and their bytes."""

    def __init__(self, monkeypatch):
        self.ops, self.bytes = collections.Counter(), 0
        policy = op_checkpoint.op_policy

        def recording(ctx, func, *args, **kwargs):
            decision = policy(ctx, func, *args, **kwargs)
            if not ctx.is_recompute and decision == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE:
                self.ops[func] += 1
                outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
                self.bytes += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return decision
        monkeypatch.setattr(op_checkpoint, "op_policy", recording)


def _grads(model: Llama, tokens: torch.Tensor, seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks
    model(tokens).float().mean().backward()
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def test_a_dense_block_keeps_its_matmuls_and_attention_and_its_gradients_equal_none(monkeypatch):
    plain = _llama()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, "selective_op", 2) == 2  # every block, whatever ac_every
    kept = _Kept(monkeypatch)
    got, want = _grads(wrapped, _tokens()), _grads(plain, _tokens())
    assert kept.ops == {aten.mm.default: 2 * LINEARS_PER_BLOCK,
                        aten._scaled_dot_product_flash_attention_for_cpu.default: 2}, kept.ops
    assert all(torch.equal(got[n], g) for n, g in want.items())


def test_kept_bytes_are_the_planners_selective_op_bytes(monkeypatch):
    """fp32, tp 1: the planner's per-block bytes = the checkpointed input + what the policy kept."""
    from hpctrain.plan.activations import selective_op_layer_bytes
    from hpctrain.plan.shape import ModelShape

    model = _llama()
    apply_activation_checkpointing(model, "selective_op", 1)
    kept = _Kept(monkeypatch)
    model(_tokens()).float().mean().backward()
    shape = ModelShape(2, 32, 4, 64, 16, arch="llama", n_kv_head=2, multiple_of=16)
    assert shape.ffn == model.cfg.ffn_hidden_size
    kept_per_block = kept.bytes // 2
    block_input = 4 * 2 * 16 * 32  # the wrapper's input, fp32
    assert block_input + kept_per_block == selective_op_layer_bytes(shape, micro_batch=2, tp=1, half=False)


def test_dropout_masks_are_drawn_again_so_gradients_equal_none(monkeypatch):
    """dropout 0.1: on the CPU SDPA runs its math form (two bmm, softmax, dropout): the bmm are kept,
    the dropouts recomputed from the restored RNG state draw the forward's masks."""
    plain = _llama(dropout=0.1)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "selective_op", 1)
    kept = _Kept(monkeypatch)
    got, want = _grads(wrapped, _tokens()), _grads(plain, _tokens())
    assert kept.ops == {aten.mm.default: 2 * LINEARS_PER_BLOCK, aten.bmm.default: 2 * 2}, kept.ops
    assert all(torch.equal(got[n], g) for n, g in want.items())


def test_a_fused_attention_kernel_with_dropout_is_recomputed():
    """A fused SDPA kernel (CUDA flash / efficient / cuDNN, the CPU's flash) draws its dropout mask
    inside: kept, its recomputation would not advance the generator and every dropout after it in
    the block would draw another mask than the forward's. With dropout_p 0 it is kept."""
    from torch.utils.checkpoint import CheckpointPolicy as P

    q = torch.zeros(1, 1, 4, 8)
    decide = lambda func, *args, **kw: op_checkpoint.op_policy(None, func, *args, **kw)  # noqa: E731
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default):
        assert decide(op, q, q, q, 0.1) == P.PREFER_RECOMPUTE and decide(op, q, q, q, 0.0) == P.MUST_SAVE
        assert decide(op, q, q, q, dropout_p=0.1) == P.PREFER_RECOMPUTE and decide(op, q, q, q) == P.MUST_SAVE
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert decide(efficient, q, q, q, None, True, 0.1) == P.PREFER_RECOMPUTE
    assert decide(efficient, q, q, q, None, True, 0.0) == P.MUST_SAVE
    with torch.no_grad():  # inside a custom autograd.Function's forward (context parallelism's ring)
        assert decide(aten.mm.default, q, q) == P.PREFER_RECOMPUTE


def test_a_moe_block_keeps_its_grouped_matmuls_routing_and_host_counts(monkeypatch):
    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01)
    plain = _llama(moe=moe)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "selective_op", 1)
    kept = _Kept(monkeypatch)
    got, want = _grads(wrapped, _tokens()), _grads(plain, _tokens())
    assert kept.ops[aten._grouped_mm.default] == 2 * 3, kept.ops  # w1, w3, w2 of each layer
    assert kept.ops[aten.topk.default] == 2, kept.ops  # the routing
    assert all((g is None and got[n] is None) or torch.equal(got[n], g) for n, g in want.items())


def test_the_cuda_expert_path_keeps_the_host_copy_of_its_counts(monkeypatch):
    """The experts' CUDA form (sized by host counts, run on the CPU as test_moe_host_syncs does):
    each layer's `.to("cpu")` of its counts is kept, so the recomputation does not sync again."""
    from hpctrain.model import moe as moe_module

    monkeypatch.setattr(moe_module, "_grouped_mm_fits", lambda *tensors: False)
    monkeypatch.setattr(moe_module, "_cuda_grouped_mm_fits", lambda x, w1: x.shape[0] > 0)
    plain = _llama(moe=MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01))
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "selective_op", 1)
    kept = _Kept(monkeypatch)
    got, want = _grads(wrapped, _tokens()), _grads(plain, _tokens())
    assert kept.ops[aten._to_copy.default] == 2, kept.ops
    assert all((g is None and got[n] is None) or torch.equal(got[n], g) for n, g in want.items())


def test_the_planner_keeps_selective_op_blocks_between_none_and_full_and_repeats_no_flops():
    """llama3-8b, fsdp dp8, bf16: activations of none less selective_op's = 32 blocks x (a block
    less its kept bytes) less the recomputed block's (a block less its kept bytes + its input);
    compute time = none's (no matmul repeated), full's 1 + 1/3 of it."""
    from dataclasses import replace

    from hpctrain.plan import memory
    from hpctrain.plan.layout import Job
    from hpctrain.plan.shape import PRESETS
    from hpctrain.plan.step_time import step_time

    shape = PRESETS["llama3-8b"]
    job = Job(nodes=1, gpus_per_node=8, micro_batch=1, data_parallel="fsdp",
              activation_checkpoint="selective_op").check(shape)
    mem = memory.largest_rank(shape, job)
    by = mem.activations_by_mode
    layer, kept = memory.job_layer_bytes(shape, job), memory.job_selective_op_bytes(shape, job)
    ckpt = memory.job_checkpointed_bytes(shape, job)
    assert by["none"] - by["selective_op"] == shape.n_layer * (layer - kept) - (layer - kept + ckpt)
    assert by["full"] < by["selective_op"] < by["none"] and mem.parts["activations"] == by["selective_op"]
    compute = {m: step_time(shape, replace(job, activation_checkpoint=m), mem).compute
               for m in ("none", "selective_op", "full")}
    assert compute["selective_op"] == compute["none"] and compute["full"] == pytest.approx(compute["none"] * 4 / 3)
