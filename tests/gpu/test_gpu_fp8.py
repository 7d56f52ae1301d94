"""train.precision = "fp8" on a GPU with float8 tensor cores (H100, H200; compute capability >= 8.9):
real float8 matmuls (torch._scaled_mm: one matmul of two float8 tensors per converted Linear layer in a forward), a Llama that
trains like bf16 with either recipe, and with fp8.fsdp_all_gather FSDP2 all-gathering the converted
weights in float8 (needs 2 GPUs: FSDP2 gathers nothing on one). The same wiring with emulated
float8 on CPUs: tests/mpi/test_fp8.py. Skipped, with the reason, without such a GPU or torchao.
The tolerances are first guesses until a device run measures them (docs/benchmarks.md)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ROOT, losses, mpirun, records
from tests.helpers import PARITY_GPT
from tests.mpi.test_llama_parallel import LLAMA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9),
                       reason="needs a CUDA GPU of compute capability >= 8.9 (float8 tensor cores)"),
]
pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'hpctrain[fp8]'")

STEPS = 20
GPU = ["--dist.backend=nccl", f"--train.steps={STEPS}", "--train.log_interval=1", "--checkpoint.interval=100"]


def write(tmp_path, dataset, name: str):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(PARITY_GPT.format(run=tmp_path / name, data=dataset))
    return cfg, tmp_path / name


def train_gpu(tmp_path, dataset, name: str, *overrides) -> tuple[str, dict]:
    cfg, run = write(tmp_path, dataset, name)
    r = mpirun(1, ["-m", "hpctrain", "train", "--config", cfg, *LLAMA, *GPU, *overrides], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stderr, losses(run)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_like_bf16(tmp_path, dataset, recipe):
    _, bf16 = train_gpu(tmp_path, dataset, "bf16", "--train.precision=bf16")
    err, fp8 = train_gpu(tmp_path, dataset, "fp8", "--train.precision=fp8", f"--fp8.recipe={recipe}")
    assert f"fp8 ({recipe}): 28 of 29 Linear layers converted" in err, err[-3000:]
    assert sorted(fp8) == sorted(bf16) == list(range(1, STEPS + 1))
    worst = max(abs(fp8[s] - bf16[s]) / bf16[s] for s in bf16)
    print(f"fp8 {recipe} vs bf16: worst relative loss difference {worst:.2e}; "
          f"tokens/s {[r.get('tokens_per_s') for r in records(tmp_path / 'fp8')][-1]} vs "
          f"{[r.get('tokens_per_s') for r in records(tmp_path / 'bf16')][-1]}")
    assert worst <= 0.03, (bf16, fp8)
    assert fp8[STEPS] < fp8[1] - 0.5  # it learns


def probe(tmp_path, dataset, n: int, *overrides) -> dict:
    cfg, _ = write(tmp_path, dataset, "probe")
    r = mpirun(n, [ROOT / "tests/mpi/scripts/fp8_all_gather_probe.py", "nccl", cfg, *LLAMA,
                   "--train.precision=fp8", *overrides], timeout=300, check=True)
    return {k: json.loads(v) for k, v in (line.split(" ", 1) for line in r.stdout.splitlines()
                                          if line.startswith(("GATHERED", "CONVERTED", "FLOAT8_MM")))}


def test_each_converted_layer_runs_one_float8_matmul_in_the_forward(tmp_path, dataset):
    got = probe(tmp_path, dataset, 1)
    assert got["FLOAT8_MM"] == 28 and got["CONVERTED"] > 0, got  # 4 blocks x 7 Linear layers


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 all-gathers nothing on one GPU")
def test_fsdp_all_gathers_the_converted_weights_in_float8(tmp_path, dataset):
    fsdp = ("--parallel.data_parallel=fsdp", "--train.grad_accum=1")
    plain = probe(tmp_path, dataset, 2, *fsdp)
    fp8 = probe(tmp_path, dataset, 2, *fsdp, "--fp8.fsdp_all_gather=true")
    assert set(plain["GATHERED"]) == {"bfloat16"} and "uint8" in fp8["GATHERED"], (plain, fp8)
    assert sum(plain["GATHERED"].values()) - sum(fp8["GATHERED"].values()) == fp8["CONVERTED"]
