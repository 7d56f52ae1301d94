"""MPI probe for tests/mpi/test_qwen3.py: Qwen3's tensor-parallel plan (its ModelSpec.block_tp_plan,
hpctrain/model/qwen3/spec.py, applied by parallel/tensor_parallel.py) gives the unsplit model's loss
and every gradient, the per-head q/k norms' included.

    mpiexec -n 2 python qwen3_tp_probe.py

Each rank builds a small Qwen3 (head width 16 != n_embd / n_head; GQA) twice from one seed, dense
and with Qwen3-MoE layers in every other block, splits one copy over tp = 2 (with and without
sequence parallelism), runs one forward / backward on the same tokens, and compares the loss and
each gradient (DTensors gathered whole) with the unsplit copy's. Rank 0 prints one line per case:
`SAME <case> <n_grads> <worst |d|>` or `DIFF <case> <fqn> <|d|>`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hpctrain.distributed.abort import run_or_abort
from hpctrain.distributed.bootstrap import init_distributed, teardown
from hpctrain.model import spec
from hpctrain.model.qwen3.model import build as build_model
from hpctrain.parallel.tensor_parallel import apply_tensor_parallel, sum_moe_grads_over_tp, tp_token_split_moe

DENSE = dict(n_layer=2, n_head=4, n_kv_head=2, head_dim=16, n_embd=32, block_size=16,
             vocab_size=130, ffn_hidden=48)
MOE = dict(DENSE, moe_experts=4, moe_top_k=2, moe_expert_hidden=24, moe_every=2)
CASES = {"dense_sp": (DENSE, True), "dense_nosp": (DENSE, False), "moe_sp": (MOE, True),
         "moe_nosp": (MOE, False)}


def loss_and_grads(model, tokens) -> tuple[float, dict[str, torch.Tensor]]:
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    layers, group = tp_token_split_moe(model)
    if layers:
        sum_moe_grads_over_tp(layers, group)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def check(mesh, name: str, section: dict, sp: bool) -> str:
    torch.manual_seed(7)
    ref = build_model(section)
    torch.manual_seed(7)
    split = build_model(section)
    m = spec.as_args({**section, "arch": "qwen3"})
    apply_tensor_parallel(split, mesh, lambda layer: spec.get("qwen3").block_tp_plan(m, layer), sp)
    tokens = torch.randint(0, section["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    want, ref_grads = loss_and_grads(ref, tokens)
    got, grads = loss_and_grads(split, tokens)
    if set(grads) != set(ref_grads):
        return f"DIFF {name} names {sorted(set(grads) ^ set(ref_grads))}"
    worst = max(((g - ref_grads[n]).abs().max().item(), n) for n, g in grads.items())
    if worst[0] > 1e-5 or abs(got - want) > 1e-5:
        return f"DIFF {name} {worst[1]} {worst[0]:.3g} loss {got} {want}"
    return f"SAME {name} {len(grads)} {worst[0]:.3g}"


def main() -> None:
    ctx = init_distributed("gloo")
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    for name, (section, sp) in CASES.items():
        line = check(mesh, name, section, sp)
        if ctx.rank == 0:
            print(line, flush=True)
    teardown()


if __name__ == "__main__":
    run_or_abort(main)
