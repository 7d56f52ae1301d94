"""init.from a Hugging Face folder trains at a shorter `model.block_size` than the folder's
positions (#48): the training length, up to max_position_embeddings (gpt2: n_positions); the
checkpoint records the folder's (`model.max_positions`) and the export writes it back, with the
folder's rope settings, GPT-2's whole position table (rows past the training length untouched:
no gradient, no weight decay) and logits transformers' class reproduces. Above the folder's
limit: one line naming model.block_size. Before: "conflicts with init.from ... remove the key".

Folders built here with transformers (random weights, never downloaded); runs of 2 steps on the
first play in bytes (`one_play`), one process each.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import RUN_DATA, losses, run_cmd
from tests.hf_models import OFFLINE, hf_logits, make_hf_model

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
CONFIG = RUN_DATA + """verify = "size"
cache_dir = "off"
[init]
from = "{hf}"
[train]
steps = 2
warmup_steps = 0
micro_batch_size = 2
eval_interval = 0
log_interval = 1
[checkpoint]
interval = 1
"""


def hpctrain(*args):
    return run_cmd([sys.executable, "-m", "hpctrain", *args], timeout=300, env=OFFLINE)


def train(tmp_path, data, hf, name, *overrides):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(CONFIG.format(run=tmp_path / name, data=data, hf=hf))
    return tmp_path / name, hpctrain("train", "--config", cfg, *overrides)


def one_error(r, *words):
    """The one error line of a refused run (beside warnings such as the val split's)."""
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning: ")]
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert all(w in lines[0] for w in words) and "Traceback" not in r.stderr, lines[0]
    return lines[0]


def ours_and_theirs(run, out, t: int):
    """Our checkpoint's logits and transformers' on the export, on 2 sequences of t tokens."""
    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.model import build_model_from_section

    sd, section = load_model_state(find_checkpoint(run))
    ours = build_model_from_section({**section, "dropout": 0.0}).eval()
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 257, (2, t), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return section, ours(tokens), hf_logits(out, tokens)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_len") / "llama"
    make_hf_model("llama_gqa_untied", folder, vocab_size=320, max_position_embeddings=256,
                  rope_scaling=ROPE)
    return folder


def test_llama_trains_at_64_of_256_resumes_and_exports_256(tmp_path, one_play, llama_dir):
    run, r = train(tmp_path, one_play, llama_dir, "run", "--model.block_size=64",
                   "--train.stop_at_step=1")
    assert r.returncode == 0, r.stderr[-3000:]
    run, r = train(tmp_path, one_play, llama_dir, "run", "--model.block_size=64")  # resumes
    assert r.returncode == 0 and sorted(losses(run)) == [1, 2], r.stderr[-3000:]
    out = tmp_path / "hf_out"
    r = hpctrain("export", "--checkpoint", run, "--output", out)
    assert r.returncode == 0, r.stderr
    section, ours, theirs = ours_and_theirs(run, out, 64)
    assert (section["block_size"], section["max_positions"]) == (64, 256)
    assert (theirs - ours).abs().max().item() < 1e-4
    folder = json.loads((llama_dir / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 256 and config["rope_scaling"] == {
        k: v for k, v in folder["rope_parameters"].items() if k != "rope_theta"}
    assert config["rope_theta"] == folder["rope_parameters"]["rope_theta"] == 500000.0
    before, after = load_file(llama_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after) and any(not torch.equal(before[k], after[k]) for k in before)

    # a resume at another length: one line (its sample order counts block_size + 1 windows)
    _, r = train(tmp_path, one_play, llama_dir, "run", "--model.block_size=32", "--train.steps=3")
    one_error(r, "config key 'model.block_size': 32 differs from checkpoint", "(64)", "init.from")


def test_block_size_above_the_folder_is_one_line(tmp_path, one_play, llama_dir):
    _, r = train(tmp_path, one_play, llama_dir, "run", "--model.block_size=257")
    line = one_error(r, "config key 'model.block_size': 257 exceeds init.from",
                     "max_position_embeddings (256)")
    assert not (tmp_path / "run" / "checkpoints").exists(), line


def test_gpt2_trains_at_32_of_128_and_keeps_the_table(tmp_path, one_play):
    hf = tmp_path / "gpt2"
    make_hf_model("gpt2", hf, n_positions=128, vocab_size=320)
    run, r = train(tmp_path, one_play, hf, "run", "--model.block_size=32")
    assert r.returncode == 0 and sorted(losses(run)) == [1, 2], r.stderr[-3000:]
    out = tmp_path / "hf_out"
    assert hpctrain("export", "--checkpoint", run, "--output", out).returncode == 0
    section, ours, theirs = ours_and_theirs(run, out, 32)
    assert (section["block_size"], section["max_positions"]) == (32, 128)
    assert (theirs - ours).abs().max().item() < 1e-4
    config = json.loads((out / "config.json").read_text())
    assert config["n_positions"] == config["n_ctx"] == 128
    before = load_file(hf / "model.safetensors")["transformer.wpe.weight"]
    after = load_file(out / "model.safetensors")["transformer.wpe.weight"]
    assert after.shape == before.shape == (128, 32)
    assert torch.equal(after[32:], before[32:])  # no gradient, no decay: bit for bit
    assert not torch.equal(after[:32], before[:32])  # trained (weight decay 0.1 and lr as default)


def raw_config(tmp_path, hf, **model) -> dict:
    return {"run": {"dir": str(tmp_path / "run")}, "data": {"path": str(tmp_path)},
            "train": {"steps": 1, "warmup_steps": 0, "micro_batch_size": 1},
            "init": {"from": str(hf)}, **({"model": model} if model else {})}


def test_a_131072_folder_sets_the_length_and_passes_the_size_check(tmp_path):
    """A Llama-3.1-like config.json (131,072 positions, rope scaling): no block_size given, the
    run trains at the folder's length, as before; given, at that one (an override's string
    too). The model size check (16 B per parameter against the job's memory) grows with
    parameters only: a rotary model's length is none of them, nor, past block_size, gpt2's."""
    from hpctrain.config import from_dict
    from hpctrain.plan.shape import ModelShape
    from hpctrain.train.model_setup import size_error

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 80, "vocab_size": 320,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": ROPE}))
    model = from_dict(raw_config(tmp_path, hf)).model
    assert (model.block_size, model.max_positions, model.rope_scaling_factor) == (131072, 131072, 8.0)
    assert size_error(model, 10**8, "100 MB") is None  # ~30k parameters: 0.5 MB of state
    assert from_dict(raw_config(tmp_path, hf, block_size="2048")).model.block_size == 2048
    with pytest.raises(Exception, match="'model.max_positions': '4096' conflicts with init.from"):
        from_dict(raw_config(tmp_path, hf, max_positions="4096"))
    gpt2 = ModelShape(n_layer=1, n_embd=32, n_head=4, vocab_size=320, block_size=32, max_positions=1024)
    assert gpt2.position_params == 1024 * 32 and gpt2.position_params_tp(2) == 512 * 32
    assert gpt2.num_params() == gpt2.total_params() - 1024 * 32  # the table: not in MFU's N


def test_max_positions_below_block_size_is_refused(tmp_path):
    from hpctrain.config import from_dict

    raw = raw_config(tmp_path, tmp_path)
    del raw["init"]
    raw["model"] = {"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 257, "block_size": 64,
                    "max_positions": 32}
    with pytest.raises(Exception, match="'model.max_positions': 32: must be 0 .* >= model.block_size=64"):
        from_dict(raw)
