"""`hpctrain ckpt list|verify` and `hpctrain export --format hf`, as a user runs them (subprocess).

The export is checked against Hugging Face transformers (a test-only dependency, dev extra): the
exported folder loads with GPT2LMHeadModel.from_pretrained and gives our model's logits within 1e-4.
"""
from __future__ import annotations

import json
import os
import pickle
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from hpctrain.checkpoint import CheckpointManager
from hpctrain.model import GPT, GPTConfig
from tests.conftest import run_cmd

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "vocab_size": 101,
         "dropout": 0.0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run dir with two GPT checkpoints written by the manager (one process, no group) and
    random (not init-time) weights so that every bias and norm matters."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(5)
    model = GPT(GPTConfig(**MODEL))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(run / "checkpoints", keep=3, rank=0, world_size=1, full_checksums=True)
    for step in (10, 20):
        msd, osd = get_state_dict(model, opt)
        mgr.save(step, {"model": msd, "optim": osd},
                 {"step": step, "config": {"model": MODEL}, "tokenizer": {"eot_id": 100}})
    return run, model


class Payload:
    """Unpickling this runs `touch <marker>` (os.system)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hpctrain(*args, **kw):
    return run_cmd([sys.executable, "-m", "hpctrain", *args], timeout=120, **kw)


def test_ckpt_list_and_verify(saved, tmp_path):
    run, _ = saved
    r = hpctrain("ckpt", "list", run, check=True)
    lines = r.stdout.splitlines()
    assert lines[1].split()[:3] == ["20", "committed", "checkpoint"]
    assert lines[2].split()[:3] == ["10", "committed", "checkpoint"]
    assert lines[-1] == f"latest: {run / 'checkpoints' / 'step_00000020'}"
    r = hpctrain("ckpt", "verify", run / "checkpoints" / "step_00000020", check=True)
    assert "intact (step 20, world size 1, every file checksummed)" in r.stdout

    # a flipped byte in a data file: the default check sees it, --quick not; a truncated one: always
    import shutil
    bad = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", bad)
    shard = bad / "step_00000020" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert hpctrain("ckpt", "verify", bad / "step_00000020", "--quick").returncode == 0
    r = hpctrain("ckpt", "verify", bad / "step_00000020")
    assert r.returncode == 1 and "__0_0.distcp does not match its xxh3_128" in r.stdout
    shard.write_bytes(bytes(data[:100]))
    r = hpctrain("ckpt", "verify", bad)  # a root: every checkpoint in it
    assert r.returncode == 1
    assert f"{bad / 'step_00000020'}: __0_0.distcp has 100 bytes" in r.stdout
    assert f"{bad / 'step_00000010'}: intact" in r.stdout
    r = hpctrain("ckpt", "list", bad)
    assert "corrupt" in r.stdout and r.stdout.splitlines()[-1].endswith("step_00000010")
    r = hpctrain("ckpt", "verify", tmp_path / "nope")
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'nope'}: no such directory"


def test_ckpt_list_and_verify_read_the_metadata_without_torch(saved, tmp_path):
    """`ckpt list|verify` import no torch (they read `.metadata` as inert records: 0.4 s instead of
    2.4 s here) and see in it what the loading reader sees; a crafted file is refused by name."""
    run, _ = saved
    for args in (("list", run), ("verify", run / "checkpoints" / "step_00000020")):
        r = run_cmd([sys.executable, "-X", "importtime", "-m", "hpctrain", "ckpt", *args],
                    timeout=120, check=True)
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines()}
        assert "torch" not in imported and "hpctrain.checkpoint.metadata_scan" in imported
        assert "numpy" not in imported  # nor data_tools' shard format (numpy, h5py): 0.3 s more
        assert "committed" in r.stdout or "intact" in r.stdout

    from hpctrain.checkpoint import metadata_scan, safe_load

    def ends(md):
        return sorted((str(i.relative_path), i.offset, i.length) for i in md.storage_data.values())

    meta = run / "checkpoints" / "step_00000020" / ".metadata"
    real, records = safe_load.read_metadata(meta), metadata_scan.read_records(meta)
    assert ends(records) == ends(real) and len(ends(real)) > 20
    assert sorted(records.state_dict_metadata) == sorted(real.state_dict_metadata)

    evil, marker = tmp_path / "evil.metadata", tmp_path / "pwned"
    evil.write_bytes(pickle.dumps(Payload(marker)))
    for read in (safe_load.read_metadata, metadata_scan.read_records):
        with pytest.raises(safe_load.UnsafeCheckpointError, match="refusing to unpickle posix.system"):
            read(evil)
    assert not marker.exists()


def test_export_hf_matches_transformers_logits(saved, tmp_path):
    from transformers import GPT2LMHeadModel

    run, model = saved
    out = tmp_path / "hf"
    r = hpctrain("export", "--checkpoint", run, "--format", "hf", "--output", out, check=True)
    assert "step 20" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_layer"], cfg["n_head"]) == (101, 16, 2, 4)
    assert cfg["eos_token_id"] == 100

    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    model.eval()
    tokens = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_of_a_trained_run_gives_its_weights_logits(dataset, tmp_path):
    """A checkpoint the trainer wrote (optimizer, sampler and RNG state beside the model): the HF
    folder gives the logits of the trained weights, read here with torch's own DCP loader."""
    import torch.distributed.checkpoint as dcp
    from transformers import GPT2LMHeadModel

    from hpctrain.model import build_model_from_section
    from tests.conftest import TINY_TRAIN

    cfg = tmp_path / "run.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp_path / "run", data=dataset, steps=3))
    run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg, "--train.lr=0.01"],
            timeout=300, check=True)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    out = tmp_path / "hf"
    hpctrain("export", "--checkpoint", tmp_path / "run", "--format", "hf", "--output", out, check=True)

    section = json.loads((ckpt / "trainer_state.json").read_text())["trainer"]["config"]["model"]
    trained = build_model_from_section(section)
    init = {k: v.clone() for k, v in trained.state_dict().items()}
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    trained.load_state_dict(state["model"])
    assert not torch.equal(init["blocks.0.attn.wq.weight"], state["model"]["blocks.0.attn.wq.weight"])
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trained.eval()(tokens)
        theirs = GPT2LMHeadModel.from_pretrained(out).eval()(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_export_refuses_a_corrupt_checkpoint(saved, tmp_path):
    import shutil

    run, _ = saved
    shutil.copytree(run / "checkpoints" / "step_00000010", tmp_path / "step_00000010")
    (tmp_path / "step_00000010" / "trainer_state.json").write_text("{}")
    r = hpctrain("export", "--checkpoint", tmp_path / "step_00000010", "--output", tmp_path / "o")
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {tmp_path / 'step_00000010'}: not an intact checkpoint: "
                               "trainer_state.json has 2 bytes")
