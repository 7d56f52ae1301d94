"""init.from a Hugging Face folder under a real mpiexec, and back: a LlamaForCausalLM built here
(GQA, untied, random weights; tests/unit/test_hf_import_export.py) seeds runs on 1 rank, tp=2 and
FSDP (dp=2), whose loss curves agree (<= 1e-5 relative: each rank read only its slices); the tp=2
run exported with --format hf gives transformers the logits of our model (<= 1e-4) and, with the
dataset's GPT-2 tokenizer, a text-generation pipeline that generates, offline.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import losses, mpirun, run_cmd
from tests.helpers import assert_same_curve
from tests.hf_models import OFFLINE, hf_logits, make_hf_model, pipeline_generates
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

# no [model] section: init.from's config.json gives it
CONFIG = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
[init]
from = "{hf}"
[train]
steps = 3
warmup_steps = 0
micro_batch_size = 8
eval_interval = 0
log_interval = 1
[checkpoint]
interval = 3
"""
SIZES = dict(vocab_size=50304, hidden_size=64, intermediate_size=128)  # GPT-2's tokenizer, padded


@pytest.fixture(scope="module")
def dataset(gpt2_two_plays):
    """Two plays in GPT-2 tokens: the export carries that tokenizer, so a pipeline can run."""
    return gpt2_two_plays


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The Llama folder every test imports, written once per session (tests/shared_dirs.py)."""
    return shared_dir(tmp_path_factory, "hf_src",
                      lambda out: make_hf_model("llama_gqa_untied", out / "llama", **SIZES)) / "llama"


def train(n, tmp, data, hf, name, *overrides):
    cfg = Path(tmp) / f"{name}.toml"
    cfg.write_text(CONFIG.format(run=Path(tmp) / name, data=data, hf=hf))
    args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
    r = run_cmd([sys.executable, *args], timeout=300) if n == 1 else mpirun(n, args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(tmp) / name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, dataset, hf_dir):
    """The 1-rank curve, trained once per session."""
    run = shared_dir(tmp_path_factory, "hf_one", lambda out: train(1, out, dataset, hf_dir, "one"))
    return losses(run / "one")


def test_fsdp_import_matches_one_rank(tmp_path, dataset, hf_dir, one_rank):
    run = train(2, tmp_path, dataset, hf_dir, "fsdp", "--parallel.data_parallel=fsdp",
                "--train.micro_batch_size=4")
    assert_same_curve(one_rank, losses(run), range(1, 4))


def test_tp2_import_train_export_roundtrip(tmp_path, dataset, hf_dir, one_rank):
    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.model import build_model_from_section

    run = train(2, tmp_path, dataset, hf_dir, "tp2", "--parallel.tp=2")
    assert_same_curve(one_rank, losses(run), range(1, 4))

    out = tmp_path / "hf_out"
    r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", run, "--output", out],
                timeout=180, env=OFFLINE)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    sd, section = load_model_state(find_checkpoint(run))
    ours = build_model_from_section({**section, "dropout": 0.0}).eval()
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_logits(out, tokens) - ours(tokens)).abs().max().item() < 1e-4
    # the imported weights were trained: 3 AdamW steps at lr 1e-3 move each by <= ~3e-3, while
    # they are N(0, 0.2) apart from any other init
    from safetensors.torch import load_file
    before, after = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < moved < 0.01, moved
    text = pipeline_generates(out)  # the dataset's GPT-2 tokenizer went with it
    assert text.startswith("KING HENRY") and len(text) > len("KING HENRY")


def test_folder_without_weights_is_one_line(tmp_path, dataset, hf_dir):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((hf_dir / "config.json").read_text())
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(run=tmp_path / "run", data=dataset, hf=tmp_path / "hf"))
    r = mpirun(2, ["-m", "hpctrain", "train", "--config", cfg, "--parallel.tp=2"], timeout=120)
    errors = [l for l in r.stderr.splitlines() if "error" in l.lower()]  # (+ mpiexec's Abort notice)
    assert r.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: "), r.stderr
    assert f"{tmp_path / 'hf'}: no model.safetensors" in errors[0] and "Traceback" not in r.stderr


def test_resume_after_the_folder_is_gone(tmp_path, dataset, hf_dir, one_rank):
    """A run started from init.from resumes from its checkpoint alone: [model] and the weights come
    from the checkpoint, the tokenizer from its dataset record (before: 'config key 'init.from':
    DIR/config.json not found' on resume). The straight run is `one_rank` (the same 3 steps from
    the same weights)."""
    import shutil

    hf = shutil.copytree(hf_dir, tmp_path / "hf")
    train(1, tmp_path, dataset, hf, "resumed", "--train.stop_at_step=2", "--checkpoint.interval=2")
    shutil.rmtree(hf)
    run = train(1, tmp_path, dataset, hf, "resumed")
    assert losses(run) == one_rank and sorted(one_rank) == [1, 2, 3], (losses(run), one_rank)
    r = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", run, "--prompt", "KING",
                 "--tokens", "8"], timeout=120, env=OFFLINE)
    assert r.returncode == 0 and "step_00000003" in r.stdout and "KING" in r.stdout, r.stderr
