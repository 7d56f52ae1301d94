"""train.loss_chunk under a real mpiexec: the chunked linear + cross-entropy reproduces the plain
1-rank loss curve (training and validation) on one rank, TP's vocabulary-parallel head, FSDP and a
pipeline's last stage, for a tiny GPT (2 blocks, 64 wide, 32 tokens, 257 byte vocab) and a tiny
Llama (GQA, untied head) on tp=2; fp32; chunks of 24 tokens do not divide a micro-batch's 64 or
128 tokens. `sample` works on a run trained with it (it builds the plain head)."""
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import model_section, mpirun, run_cmd
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

CONFIG = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
""" + model_section(n_head=4, block_size=32) + """[train]
steps = 6
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
warmup_steps = 2
eval_interval = 3
eval_batches = 2
log_interval = 1
"""
CHUNK = ["--train.loss_chunk=24"]
# every layout: 8 sequences per step and the same 8 validation sequences (eval_batches x mb x dp)
LAYOUTS = {
    "one": (1, CHUNK),
    "tp2": (2, CHUNK + ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1",
                        "--train.eval_batches=1"]),
    "fsdp2": (2, CHUNK + ["--parallel.data_parallel=fsdp", "--train.grad_accum=1",
                          "--train.eval_batches=1"]),
    "pp2_1f1b": (2, CHUNK + ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4",
                             "--train.eval_batches=4"]),
}


LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32"]


def train(n, tmp, data, overrides, keep=None):
    run, cfg = Path(tmp) / "run", Path(tmp) / "c.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(CONFIG.format(run=run, data=data))
    if keep is not None:
        keep.append(run)
    args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
    if n == 1:
        run_cmd([sys.executable, *args], timeout=300, check=True)
    else:
        mpirun(n, args, timeout=300, check=True)
    return curves(run)


def curves(run: Path) -> tuple[dict, dict]:
    """({step: loss}, {step: val_loss}) of a run."""
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in recs if "loss" in r},
            {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})


@pytest.fixture(scope="module")
def plain(tmp_path_factory, dataset):
    """The 1-rank curves, trained once per session (tests/shared_dirs.py)."""
    out = shared_dir(tmp_path_factory, "chunked_plain", lambda tmp: train(1, tmp, dataset, []))
    return curves(out / "run")


def assert_same_curves(plain, got, layout):
    for ref, new in zip(plain, got):  # training losses, then validation losses
        assert sorted(new) == sorted(ref) and ref, (sorted(ref), sorted(new))
        for step in ref:
            assert abs(new[step] - ref[step]) <= 1e-5 * abs(ref[step]), (layout, step, ref, new)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_loss_matches_plain_curve(tmp_path, dataset, plain, layout):
    n, overrides = LAYOUTS[layout]
    runs = []
    assert_same_curves(plain, train(n, tmp_path, dataset, overrides, runs), layout)
    if layout == "one":  # sampling needs logits: the checkpoint samples as any other
        r = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", runs[0],
                     "--tokens", "20", "--prompt", "KING"], timeout=120)
        text = r.stdout.split("\n", 1)[1]  # after the '# checkpoint ...' line
        assert r.returncode == 0 and text.startswith("KING") and len(text) >= 15, r.stdout


def test_llama_chunked_loss_on_tp2_matches_plain(tmp_path, dataset):
    plain = train(1, tmp_path / "plain", dataset, LLAMA)
    got = train(2, tmp_path / "tp2", dataset, LLAMA + LAYOUTS["tp2"][1])
    assert_same_curves(plain, got, "llama_tp2")
