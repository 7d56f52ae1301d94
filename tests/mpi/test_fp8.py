"""train.precision = "fp8" under a real mpiexec on CPUs, with torchao's emulated float8 matmuls
(fp8.emulate: fp8's numbers, fp32 math; a CPU has no float8 tensor cores): a Llama on FSDP2 over
2 ranks trains like bf16, resumes from its step-2 checkpoint bit for bit, its checkpoints hold
plain tensors (`hpctrain sample` reads them without torchao), and with
fp8.fsdp_all_gather FSDP2 all-gathers the converted layers' weights in float8 (one byte per
element instead of bf16's two). Without emulate a CPU run is refused in one line.
The same on a GPU with real float8 matmuls: tests/gpu/test_gpu_fp8.py."""
import json
import re
import sys

import pytest

from tests.conftest import ROOT, losses, mpirun, run_cmd
from tests.helpers import PARITY_GPT, copy_run_at
from tests.helpers import train_layout as train
from tests.mpi.test_llama_parallel import LLAMA, STEPS

pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'hpctrain[fp8]'")
pytestmark = pytest.mark.mpi

FSDP2 = ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]
FP8 = ["--train.precision=fp8", "--fp8.emulate=true", "--fp8.fsdp_all_gather=true"]


def test_emulated_fp8_trains_like_bf16_and_resumes_bit_for_bit(tmp_path, dataset):
    _, bf16 = train(2, tmp_path, dataset, "bf16", *LLAMA, *FSDP2, "--train.precision=bf16")
    r, fp8 = train(2, tmp_path, dataset, "fp8", *LLAMA, *FSDP2, *FP8)
    want, got = losses(bf16), losses(fp8)
    assert sorted(got) == list(STEPS)
    assert all(abs(got[s] - want[s]) <= 2e-3 * want[s] for s in STEPS), (want, got)
    assert got != want  # the float8 matmuls ran: not bf16's numbers (here within 1.6e-4)
    converted = re.search(r"fp8 \(tensorwise, float8 FSDP all-gather, emulated\): (\d+) of (\d+) "
                          r"Linear layers converted; kept in bf16: lm_head \(fp8.skip\)", r.stderr)
    assert converted and converted.groups() == ("28", "29"), r.stderr[-3000:]  # 4 blocks x 7
    # its checkpoint holds plain tensors: sampled by a process that never imports torchao
    sample = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", fp8, "--tokens", "4"])
    assert sample.returncode == 0, sample.stderr[-2000:]
    copy_run_at(fp8, tmp_path / "resumed", 2)
    r, resumed = train(2, tmp_path, dataset, "resumed", *LLAMA, *FSDP2, *FP8)
    assert "step_00000002" in r.stderr
    again = losses(resumed)
    assert [again[s] for s in STEPS] == [got[s] for s in STEPS]


def probe(tmp_path, dataset, *overrides) -> dict:
    """tests/mpi/scripts/fp8_all_gather_probe.py on 2 ranks: GATHERED (bytes all-gathered in one
    forward, by dtype), CONVERTED (elements of the converted weights), FLOAT8_MM (float8 matmuls)."""
    cfg = tmp_path / "probe.toml"
    cfg.write_text(PARITY_GPT.format(run=tmp_path / "probe", data=dataset))
    r = mpirun(2, [ROOT / "tests/mpi/scripts/fp8_all_gather_probe.py", "gloo", cfg,
                   *LLAMA, *FSDP2, *overrides], timeout=300, check=True)
    return {k: json.loads(v) for k, v in (line.split(" ", 1) for line in r.stdout.splitlines()
                                          if line.startswith(("GATHERED", "CONVERTED", "FLOAT8_MM")))}


def test_fsdp_all_gathers_the_converted_weights_in_float8(tmp_path, dataset):
    """The same forward all-gathers one byte less per element of every converted weight with
    fp8.fsdp_all_gather (float8 bytes, in FSDP2's uint8 buffer) than without (bf16); either way
    each converted layer runs one float8 matmul (4 blocks x 7 Linear layers)."""
    plain = probe(tmp_path, dataset, "--train.precision=fp8", "--fp8.emulate=true")
    fp8 = probe(tmp_path, dataset, *FP8)
    assert set(plain["GATHERED"]) == {"bfloat16"} and "uint8" in fp8["GATHERED"], (plain, fp8)
    assert plain["CONVERTED"] == fp8["CONVERTED"] > 0
    assert sum(plain["GATHERED"].values()) - sum(fp8["GATHERED"].values()) == fp8["CONVERTED"]
    assert plain["FLOAT8_MM"] == fp8["FLOAT8_MM"] == 28


def test_fp8_on_a_cpu_without_emulate_is_refused_in_one_line(tmp_path, dataset):
    r, _ = train(1, tmp_path, dataset, "cpu", *LLAMA, "--train.precision=fp8", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if "'train.precision'" in x]
    assert "'bf16'" in line and "fp8.emulate" in line  # what to do instead
