"""Expert parallelism on NCCL (#34, hpctrain/parallel/expert.py): a mixture-of-experts Llama with
its 4 experts sharded over 2 GPUs (parallel.ep=2, dp2) trains on NCCL, whose collectives refuse any
tensor off the GPU (the token counts' all-to-all was a CPU tensor: "No backend type associated
with device type cpu"), and follows the one-GPU run of the same global batch. The CPU form of the
device check: tests/mpi/test_expert_parallel.py. With parallel.deterministic_experts (#49): dp2
with ep1 (the expert gradients summed over two replicas by NCCL point-to-point, which hung when
both ranks sent first) finishes, and two runs give bit-equal losses and grad norms; ep2
deterministic (per-source blocks on CUDA) finishes and follows the non-deterministic ep2 run.
Skipped, with the reason, without 2 CUDA GPUs."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY_TRAIN, mpirun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (expert parallelism over NCCL, ep=2)")]

STEPS = 10
MOE = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32", "--model.moe_experts=4",
       "--model.moe_top_k=2", "--train.global_batch=4", "--dist.backend=nccl", "--train.tf32=false"]


def train(tmp_path, dataset, ranks, name, *overrides, keys=("loss",)):
    """{step: loss}, or {step: (values of keys)} for several keys."""
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=STEPS))
    r = mpirun(ranks, ["-m", "hpctrain", "train", "--config", cfg, *MOE, *overrides], timeout=400)
    assert "No backend type associated" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    picked = {x["step"]: tuple(x[k] for k in keys) for x in recs if all(k in x for k in keys)}
    return {step: v[0] for step, v in picked.items()} if len(keys) == 1 else picked


def test_ep2_on_nccl_trains_as_one_gpu(tmp_path, dataset):
    ep2 = train(tmp_path, dataset, 2, "ep2", "--parallel.ep=2")
    one = train(tmp_path, dataset, 1, "one")
    assert sorted(ep2) == sorted(one) == list(range(1, STEPS + 1))
    worst = max(abs(ep2[s] - one[s]) / abs(one[s]) for s in one)
    assert worst <= 1e-4, (worst, ep2, one)
    assert ep2[STEPS] < ep2[1] - 0.1, ep2  # it trains (gloo on CPU, same config: 5.57 -> 5.38)


DETERMINISTIC = ["--parallel.deterministic_experts=true", "--dist.timeout_s=120"]  # a hang: 120 s


def test_deterministic_experts_on_nccl_finish_and_repeat_bit_for_bit(tmp_path, dataset):
    runs = [train(tmp_path, dataset, 2, f"det{i}", *DETERMINISTIC, keys=("loss", "grad_norm"))
            for i in range(2)]
    assert sorted(runs[0]) == list(range(1, STEPS + 1)) and runs[0] == runs[1], runs
    dp2 = {step: loss for step, (loss, _) in runs[0].items()}
    ep2 = train(tmp_path, dataset, 2, "ep2_det", "--parallel.ep=2", *DETERMINISTIC)
    plain = train(tmp_path, dataset, 2, "ep2_plain", "--parallel.ep=2")
    assert max(abs(ep2[s] - plain[s]) / abs(plain[s]) for s in plain) <= 1e-3, (ep2, plain)
    assert max(abs(dp2[s] - ep2[s]) / abs(ep2[s]) for s in ep2) <= 1e-3, (dp2, ep2)
