"""MPI probe for tests/mpi/test_deepseek_v3_tp.py: the DeepSeek-V3 family's tensor-parallel plan
(its ModelSpec.block_tp_plan, applied by hpctrain/parallel/tensor_parallel.py) gives the one-rank
model's loss and gradients.

    mpiexec -n 2 python deepseek_v3_tp_probe.py CASE [CASE ...]

CASE: sp | no_sp | no_q_lora_tied (sequence parallel, plain TP, wq without the query bottleneck
and a tied head). Every rank builds the model twice from one seed, lays one out over tp = world,
runs a forward/backward (vocabulary-parallel loss, MoE gradients summed over tp as the runner
does) and compares each gradient, gathered whole, with the plain model's. Rank 0 prints
`CASE <loss diff> <worst gradient diff> <names over 1e-5>`.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from hpctrain.distributed.bootstrap import init_distributed, teardown
from hpctrain.model import spec
from hpctrain.model.deepseek_v3.model import build
from hpctrain.parallel.tensor_parallel import apply_tensor_parallel, sum_moe_grads_over_tp, tp_token_split_moe

MODEL = dict(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=131, q_lora_rank=16,
             kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, ffn_hidden=80,
             moe_experts=8, moe_top_k=2, moe_expert_hidden=24, moe_shared_experts=2, moe_first_dense=1,
             moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5)
CASES = {"sp": ({}, True), "no_sp": ({}, False), "no_q_lora_tied": ({"q_lora_rank": 0, "tie_embeddings": True}, True)}


def check(ctx, mesh, name: str) -> None:
    changed, sp = CASES[name]
    torch.manual_seed(0)
    ref = build({**MODEL, **changed})
    torch.manual_seed(0)
    model = build({**MODEL, **changed})
    section = spec.as_args({**MODEL, **changed, "arch": "deepseek_v3"})
    apply_tensor_parallel(model, mesh, lambda layer: spec.get("deepseek_v3").block_tp_plan(section, layer), sp)
    idx = torch.randint(0, 131, (2, 16), generator=torch.Generator().manual_seed(1))
    with loss_parallel():
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
    layers, group = tp_token_split_moe(model)
    if group is not None:
        sum_moe_grads_over_tp(layers, group)
    want = F.cross_entropy(ref(idx).flatten(0, 1), idx.flatten())
    want.backward()
    worst, bad = 0.0, []
    for (fqn, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:  # an expert no token of this batch chose
            continue
        d = ((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - q.grad).abs().max().item()
        worst, bad = max(worst, d), bad + ([fqn] if d > 1e-5 else [])
    if ctx.rank == 0:
        print(f"{name} {abs(loss.item() - want.item()):.3e} {worst:.3e} {','.join(bad) or '-'}", flush=True)


def main() -> None:
    ctx = init_distributed("gloo")
    mesh = init_device_mesh("cpu", (ctx.world_size,))  # one mesh (the tp plan matches it by identity)
    for name in sys.argv[1:]:
        check(ctx, mesh, name)
    teardown()


if __name__ == "__main__":
    main()
