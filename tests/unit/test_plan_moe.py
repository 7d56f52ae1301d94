"""`hpctrain plan` for a mixture-of-experts llama (#34, hpctrain/plan/moe.py): total and active
parameters against the real model (meta device), the experts split over parallel.ep in the memory
per rank (DDP and FSDP), the all-to-all bytes of the token dispatch computed by hand, MFU on the
active count, and the Mixtral-8x7B preset."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from hpctrain.model import build_model_from_section
from hpctrain.plan.layout import Job
from hpctrain.plan.report import make_plan
from hpctrain.plan.shape import PRESETS, ModelShape
from hpctrain.plan.step_time import step_time
from tests.conftest import run_cmd

# 4 layers, 8 experts of width 96, top 2; the first layer dense, then every layer sparse; a gated
# shared expert of width 40 (Qwen2-MoE-like)
SHAPE = ModelShape(4, 64, 4, 97, 32, arch="llama", n_kv_head=2, multiple_of=32, moe_experts=8,
                   moe_top_k=2, moe_expert_hidden=96, moe_shared_experts=1, moe_shared_hidden=40,
                   moe_shared_gate=True, moe_first_dense=1)
JOB = Job(nodes=1, gpus_per_node=8, tokens=1e6, micro_batch=2, grad_accum=3, precision="bf16")


def test_total_and_active_parameters_are_the_real_models():
    with torch.device("meta"):
        model = build_model_from_section({**dataclasses.asdict(SHAPE), "dropout": 0.0})
    assert SHAPE.total_params() == model.num_params(non_embedding=False)
    assert SHAPE.num_params() == model.num_params()
    assert SHAPE.active_params() == model.active_params() < SHAPE.num_params()
    assert SHAPE.flops_per_token() == model.flops_per_token()  # the MFU's N is the active count


def test_experts_are_split_over_ep_in_the_memory_per_rank():
    routed = 3 * 8 * 64 * 96  # one sparse layer's routed experts: 3 E C H
    ddp = {ep: make_plan(SHAPE, dataclasses.replace(JOB, ep=ep)).mem for ep in (1, 4)}
    assert ddp[1].local_params - ddp[4].local_params == 3 * routed * 3 // 4  # 3 sparse layers
    assert ddp[4].parts["AdamW m, v (fp32)"] == 8 * ddp[4].local_params
    fsdp = make_plan(SHAPE, dataclasses.replace(JOB, ep=4, data_parallel="fsdp")).mem
    experts = 3 * routed // 4  # on this rank, whole: FSDP leaves them out (apply_fsdp's ignored_params)
    assert fsdp.parts["parameters (fp32)"] == 4 * (fsdp.local_params - experts) // 8 + 4 * experts
    assert fsdp.parts["AdamW m, v (fp32)"] == 8 * (fsdp.local_params - experts) // 8 + 8 * experts


def test_expert_gradients_are_all_reduced_over_the_replicas_only():
    """ep > 1: DDP all-reduces the dense gradients over dp = 8; the runner sums the experts' over
    the dp / ep replicas holding the same experts (2 at ep = 4, none at ep = 8)."""
    experts = 3 * 3 * 8 * 64 * 96 // 4  # 3 sparse layers' routed experts, / ep
    sent = {ep: {a: b for a, _, b, _ in make_plan(SHAPE, dataclasses.replace(JOB, ep=ep)).comm}
            for ep in (4, 8)}
    local = make_plan(SHAPE, dataclasses.replace(JOB, ep=4)).mem.local_params
    assert sent[4]["dp"] == int(2 * 7 / 8 * 4 * (local - experts)) + int(2 * 1 / 2 * 4 * experts)
    local8 = make_plan(SHAPE, dataclasses.replace(JOB, ep=8)).mem.local_params
    assert sent[8]["dp"] == int(2 * 7 / 8 * 4 * (local8 - experts // 2))


def test_all_to_all_bytes_per_step_are_tokens_x_top_k_x_hidden_x_bytes():
    plan = make_plan(SHAPE, dataclasses.replace(JOB, ep=4))
    sent = {axis: (link, b) for axis, link, b, _ in plan.comm}
    tokens = 2 * 32 * 3  # micro_batch x block_size x grad_accum
    # 3 sparse layers; dispatch + combine, forward + backward; bf16; 3 of 4 shares leave the rank
    assert sent["ep"] == ("intra-node", 4 * tokens * 2 * 3 * 64 * 2 * 3 // 4) == ("intra-node", 442_368)
    timed = step_time(SHAPE, plan.job, plan.mem)  # on the critical path, at the intra-node bandwidth
    assert timed.ep == 442_368 / JOB.intra_node_bw and timed.total >= timed.compute + timed.ep
    assert make_plan(SHAPE, JOB).comm[0][2] == 0  # ep 1: nothing moves
    # full activation checkpointing recomputes each layer's forward: 6 exchanges instead of 4
    ac = make_plan(SHAPE, dataclasses.replace(JOB, ep=4, activation_checkpoint="full")).comm
    assert ac[0][:3] == ("ep", "intra-node", 442_368 * 6 // 4)
    assert "ep" not in {a for a, *_ in make_plan(PRESETS["llama3-8b"], Job()).comm}  # dense: no row


def test_cp_with_ep_borrows_ep_from_dp_x_cp():
    """#51: cp 2 x ep on 8 GPUs (dp 4): ep divides dp x cp = 8, not only dp; a rank routes half of
    each sequence, so its all-to-all halves (the bytes per token stay); its experts are / ep as at
    cp 1, and their gradients are summed over (dp x cp) / ep replicas (none at ep 8)."""
    cp1, cp2 = (make_plan(SHAPE, dataclasses.replace(JOB, ep=4, cp=cp)) for cp in (1, 2))
    a2a = {cp: {a: b for a, _, b, _ in p.comm}["ep"] for cp, p in ((1, cp1), (2, cp2))}
    assert (a2a[1], a2a[2]) == (442_368, 442_368 // 2)
    assert cp2.mem.local_params == cp1.mem.local_params  # the experts / ep, the rest replicated
    experts = 3 * 3 * 8 * 64 * 96 // 8  # ep 8 = dp 4 x cp 2: every rank holds its own experts
    ep8 = make_plan(SHAPE, dataclasses.replace(JOB, ep=8, cp=2))
    sent = {a: b for a, _, b, _ in ep8.comm}
    assert sent["dp"] == int(2 * 7 / 8 * 4 * (ep8.mem.local_params - experts))  # no expert replicas
    assert sent["ep"] == 4 * 2 * 32 * 3 // 2 * 2 * 3 * 64 * 2 * 7 // 8  # / cp 2; 7 of 8 shares leave
    with pytest.raises(ValueError, match=r"^--ep 8 must divide dp x cp 4 "):
        dataclasses.replace(JOB, gpus_per_node=4, ep=8, cp=2).check(SHAPE)


def test_mixtral_preset_and_the_cli():
    mixtral = PRESETS["mixtral-8x7b"]
    assert round(mixtral.total_params() / 1e9, 2) == 46.70  # Mixtral's published 46.7B
    assert round(mixtral.active_params() / 1e9, 2) == 12.75  # 12.9B with the input embedding
    r = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--preset", "mixtral-8x7b", "--nodes", "2",
                 "--ep", "8", "--data-parallel", "fsdp"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 experts top 2 in 32 layers" in r.stdout and "12.7B active" in r.stdout
    assert "| ep | intra-node |" in r.stdout
    recommended = next(line for line in r.stdout.splitlines() if line.startswith("recommended:"))
    assert "--parallel.ep=8" in recommended and "tp1" in recommended  # tp > 1 refused with experts
    bad = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--preset", "mixtral-8x7b", "--ep", "3"],
                  timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--ep 3" in bad.stderr
    dense = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--preset", "llama3-8b", "--ep", "2"],
                    timeout=120)
    assert dense.returncode == 2 and "--ep 2" in dense.stderr and "moe_experts 0" in dense.stderr
