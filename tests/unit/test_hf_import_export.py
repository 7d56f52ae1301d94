"""Hugging Face model folders both ways, as a user runs them (subprocess), checked against
transformers (a test-only dependency, never downloading: HF_HUB_OFFLINE=1).

Export: `hpctrain export --format hf` writes the run's tokenizer files beside the weights, so that
`pipeline("text-generation", OUT)` generates, and shards the weights above --max-shard-size as
transformers does; gpt2 and llama, logits equal ours within 1e-4.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_state_dict

from hpctrain.checkpoint import CheckpointManager
from hpctrain.model import build_model_from_section
from tests.conftest import run_cmd
from tests.hf_models import HF_CASES, OFFLINE, hf_logits, make_hf_model, pipeline_generates

# the GPT-2 tokenizer's 50257 ids, padded as our configs do; tiny widths keep the files ~7-13 MB
GPT2 = {"arch": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32,
        "vocab_size": 50304, "dropout": 0.0}
LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "block_size": 32,
         "vocab_size": 50304, "dropout": 0.0, "rope_theta": 500000.0}
MIXTRAL = {**LLAMA, "moe_experts": 4, "moe_top_k": 2}
QWEN2_MOE = {**LLAMA, "qkv_bias": True, "ffn_hidden": 80, "moe_experts": 4, "moe_top_k": 2,
             "moe_expert_hidden": 24, "moe_shared_experts": 1, "moe_shared_hidden": 40,
             "moe_shared_gate": True, "moe_norm_topk_prob": False, "moe_every": 2}
GPT2_TOKENIZER = {"name": "gpt2", "eot_id": 50256, "vocab_size": 50257}


def hpctrain(*args, **kw):
    return run_cmd([sys.executable, "-m", "hpctrain", *args], timeout=180, env=OFFLINE, **kw)


def save_run(run, section: dict, seed: int = 5, tokenizer: dict = GPT2_TOKENIZER):
    """A run dir with one checkpoint of `section`'s model, random (not init-time) weights, whose
    dataset had `tokenizer` (a checkpoint's record: the manifest's + tokenizer_file_of)."""
    torch.manual_seed(seed)
    model = build_model_from_section(section)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    msd, _ = get_state_dict(model, [])
    mgr = CheckpointManager(run / "checkpoints", keep=1, rank=0, world_size=1)
    mgr.save(7, {"model": msd}, {"step": 7, "config": {"model": section, "data": {"path": ""}},
                                 "tokenizer": tokenizer})
    return model.eval()


@pytest.mark.parametrize("section", [GPT2, LLAMA, MIXTRAL, QWEN2_MOE],
                         ids=["gpt2", "llama", "mixtral", "qwen2_moe"])
def test_export_shards_and_writes_the_tokenizer(section, tmp_path):
    model = save_run(tmp_path / "run", section)
    out = tmp_path / "hf"
    r = hpctrain("export", "--checkpoint", tmp_path / "run", "--output", out,
                 "--max-shard-size", "2MB", check=True)
    names = sorted(p.name for p in out.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert "model.safetensors" not in names and set(shards) <= set(names)
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(names)
    total = 0
    for shard in shards:  # a 50304 x 32 embedding (6.4 MB) is a shard of its own, the rest < 2 MB
        with safe_open(str(out / shard), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert all(index["weight_map"][k] == shard for k in f.keys())
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= 2_000_000 or len(sizes) == 1
        total += nbytes
    assert index["metadata"]["total_size"] == total
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    assert (hf_logits(out, tokens) - ours).abs().max().item() < 1e-4
    if section["arch"] == "gpt2":  # llama's: tests/mpi/test_hf_roundtrip.py (on its tp=2 export)
        text = pipeline_generates(out)
        assert text.startswith("KING HENRY") and len(text) > len("KING HENRY")
        return
    # one file again below the limit, the old shards replaced (--force)
    r = hpctrain("export", "--checkpoint", tmp_path / "run", "--output", out, "--force", check=True)
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if "safetensors" in n] == ["model.safetensors"], names
    assert (hf_logits(out, tokens) - ours).abs().max().item() < 1e-4


def test_export_bad_shard_size_is_one_line(tmp_path):
    r = hpctrain("export", "--checkpoint", tmp_path, "--output", tmp_path / "o",
                 "--max-shard-size", "5XB")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: --max-shard-size '5XB'")


@pytest.mark.parametrize("kind", list(HF_CASES))
def test_import_gives_transformers_logits(kind, tmp_path):
    from hpctrain.interop import hf_import

    hf = make_hf_model(kind, tmp_path / "hf")
    section = hf_import.model_section(tmp_path / "hf")
    model = build_model_from_section({**section, "dropout": 0.0}).eval()
    assert hf_import.load_weights(model, tmp_path / "hf", section) > 0
    tokens = torch.randint(0, 131, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4


def test_import_bf16_sharded_and_conflicting_key(tmp_path):
    from hpctrain.config import from_dict
    from hpctrain.interop import hf_import

    hf = make_hf_model("llama_gqa_untied", tmp_path / "hf", torch.bfloat16, "20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    section = hf_import.model_section(tmp_path / "hf")
    model = build_model_from_section({**section, "dropout": 0.0}).eval()
    hf_import.load_weights(model, tmp_path / "hf", section)
    tokens = torch.randint(0, 131, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # hf: the bf16 values, in fp32
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4

    raw = {"run": {"dir": str(tmp_path)}, "data": {"path": str(tmp_path)},
           "train": {"steps": 1, "warmup_steps": 0, "micro_batch_size": 1}, "init": {"from": str(tmp_path / "hf")}}
    cfg = from_dict({**raw, "model": {"n_layer": "2"}})  # the same value, as an override gives it
    assert (cfg.model.arch, cfg.model.n_kv_head, cfg.init.from_dir) == ("llama", 2, str(tmp_path / "hf"))
    raw["init"] = {"from_dir": str(tmp_path / "hf")}  # the spelling --help shows
    assert from_dict(raw).model.n_kv_head == 2
    r = hpctrain("train", f"--run.dir={tmp_path}", f"--data.path={tmp_path}", "--train.steps=1", "--train.warmup_steps=0", "--train.micro_batch_size=1",
                 f"--init.from={tmp_path / 'hf'}", "--model.n_layer=4")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: config key 'model.n_layer': '4' conflicts with init.from ")
    assert "config.json" in r.stderr
