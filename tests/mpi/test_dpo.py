"""train.objective = "dpo" under a real mpiexec on a toy preference set made here (the chosen
completion is the speech that follows the prompt in a play, the rejected one its words shuffled):
the first step's loss is log 2 (the policy IS the reference), the reward margin then rises, dp2
trains the same losses as dp1 (a pair never split: 2 ranks x 1 micro-batch = 1 rank x 2), and a
run stopped at a checkpoint resumes bit-exactly, reusing the stored reference log-probs."""
import math
import os

import pytest

from data_tools.shard import shard_dataset
from tests.chat_files import chatml_folder
from tests.conftest import RUN_DATA, losses, mpirun
from tests.helpers import train
from tests.preference_files import preference_rows, write_rows

pytestmark = pytest.mark.mpi

STEPS = 8
DPO_GPT = RUN_DATA + """verify = "size"
cache_dir = "off"
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 128
vocab_size = 3000
[train]
objective = "dpo"
steps = 8
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
eval_interval = 0
log_interval = 1
[dpo]
beta = 0.1
[checkpoint]
interval = 4
keep = 2
"""


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    tok = chatml_folder(root / "tok")
    out = root / "data"
    shard_dataset([str(write_rows(root / "prefs.jsonl", preference_rows(64)))], str(out),
                  tokenizer=str(tok), val_fraction=0, progress=False, format="preference",
                  eot_token="<|endoftext|>", log=lambda m: None)
    return out


def run_dpo(tmp_path, data, name, n, *overrides, check=True):
    cfg = tmp_path / f"{name}.toml"
    if not cfg.exists():
        cfg.write_text(DPO_GPT.format(run=tmp_path / name, data=data))
    return train(n, cfg, *overrides, timeout=400, check=check), tmp_path / name


def test_dpo_margin_rises_dp2_equals_dp1_resume_is_exact(tmp_path, pref_data):
    r1, one = run_dpo(tmp_path, pref_data, "one", 1)
    loss = losses(one)
    margins, accuracies = losses(one, "rewards/margins"), losses(one, "rewards/accuracies")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert abs(loss[1] - math.log(2)) < 1e-6 and margins[1] == 0.0  # step 1: policy = reference
    assert margins[STEPS] > 0.05 and margins[STEPS] > max(margins[s] for s in (1, 2, 3))
    assert loss[STEPS] < math.log(2) - 0.03 and accuracies[STEPS] > 0.6
    assert "dpo: reference log-probs of 64 pairs" in r1.stderr

    _, two = run_dpo(tmp_path, pref_data, "two", 2, "--train.grad_accum=1")
    assert (two / "dpo_reference.npy").read_bytes() == (one / "dpo_reference.npy").read_bytes()
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        a, b = losses(one, key), losses(two, key)
        assert sorted(b) == sorted(a) and all(abs(a[s] - b[s]) <= 1e-5 for s in a), (key, a, b)

    _, split = run_dpo(tmp_path, pref_data, "split", 1, "--train.stop_at_step=4")
    reference = (split / "dpo_reference.npy").stat().st_mtime_ns
    r2, _ = run_dpo(tmp_path, pref_data, "split", 1)
    assert "resumed from" in r2.stderr and "dpo: reference" not in r2.stderr
    assert (split / "dpo_reference.npy").stat().st_mtime_ns == reference
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        assert losses(split, key) == losses(one, key), key  # bit-exact, every step


def test_pretraining_on_preference_pairs_is_refused(tmp_path, pref_data):
    r, _ = run_dpo(tmp_path, pref_data, "pretrain", 1, "--train.objective=pretrain", check=False)
    assert r.returncode != 0 and "config key 'train.objective'" in r.stderr
    assert "holds preference pairs" in r.stderr


def test_preference_shard_two_ranks_byte_identical(tmp_path):
    """`mpiexec -n 2 data_tools shard --format preference`: the bytes of 1 rank (pairs spread over
    ranks, rounds and shards; ids and masks travel packed together)."""
    tok = chatml_folder(tmp_path / "tok")
    data = write_rows(tmp_path / "prefs.jsonl", preference_rows(40))
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        mpirun(n, ["-m", "data_tools", "shard", "--format", "preference", "--input", data,
                   "--output", out, "--tokenizer", tok, "--eot-token", "<|endoftext|>",
                   "--shard-tokens", "900", "--val-fraction", "0.2", "--round-bytes", "4000",
                   "--no-progress"], timeout=240, check=True)
        outs[n] = {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}
    assert sum(n.startswith("train_") for n in outs[1]) >= 4 and "val_00000.h5" in outs[1]
    assert outs[2] == outs[1]
    assert "OK" in mpirun(1, ["-m", "data_tools", "verify", tmp_path / "n2"], timeout=120,
                          check=True).stdout
