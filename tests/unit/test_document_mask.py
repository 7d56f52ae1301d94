"""Document masking (data.document_mask, data.document_positions): a packed window's per-token
losses equal each of its documents run alone, for every family (GQA and MLA's own v width
included), through the shard reader's document ids; the off path is SDPA's is_causal call itself;
the reader's ids and positions; the config's one-line refusals (not pipeline parallelism)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import ConfigError, load
from data_tools.blend import blend_datasets
from data_tools.shard import shard_dataset
from hpctrain.data import TokenShards, open_split
from hpctrain.data.documents import DocumentBatch, document_batch, positions_in_documents, window_doc_ids
from hpctrain.model import spec
from hpctrain.model.attention import causal_attention
from hpctrain.parallel.runner import model_inputs
from tests.conftest import run_cmd
from tests.helpers import write_config

SECTION = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 48, "vocab_size": 257}
FAMILY_KEYS = {"gpt2": {}, "llama": {"n_kv_head": 2}, "qwen3": {"n_kv_head": 2, "head_dim": 8},
               "deepseek_v3": {"kv_lora_rank": 16, "q_lora_rank": 0, "qk_nope_head_dim": 8,
                               "qk_rope_head_dim": 8, "v_head_dim": 12}}
DOC_LENGTHS = (11, 7, 19, 30)  # tokens of each document, its end-of-text included
EOT = 256


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    section = {**SECTION, **FAMILY_KEYS[arch], "arch": arch}
    return spec.get(arch).model_module().build(section).eval()


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.cat([torch.randint(33, 127, (n - 1,), generator=g), torch.tensor([EOT])])
            for n in DOC_LENGTHS]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A dataset of the documents (bytes tokenizer: text i is document i) and the reader's
    DocumentBatch of its window 0 (block_size 48: documents 0-2 whole, then 12 tokens of 3)."""
    tmp = tmp_path_factory.mktemp("docs")
    texts = ["".join(chr(int(c)) for c in d[:-1]) for d in documents()]
    assert all(len(t.encode()) == len(d) - 1 for t, d in zip(texts, documents())), "ASCII only"
    (tmp / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", tmp / "in.jsonl", "--output",
             tmp / "ds", "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress"], check=True)
    with TokenShards(str(tmp / "ds"), "train", SECTION["block_size"]) as reader:
        return document_batch(reader.batch([0]), reader.document_ids([0]), with_positions=True)


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def test_reader_gives_each_token_its_document_and_position(packed):
    a, b, c = DOC_LENGTHS[:3]
    want = np.repeat([0, 1, 2, 3], [a, b, c, SECTION["block_size"] + 1 - a - b - c])
    assert packed.tokens[0].tolist() == torch.cat(documents())[:SECTION["block_size"] + 1].tolist()
    assert packed.doc_ids[0].tolist() == want.tolist()
    assert packed.positions[0].tolist() == [i for n in (a, b, c) for i in range(n)] + list(range(12))


def test_blend_windows_carry_their_component_document_ids(tmp_path):
    """A blend's row is its component's window: tokens and document ids alike."""
    g = np.random.default_rng(0)
    for name in "ab":
        lines = ["".join(chr(c) for c in g.integers(97, 123, g.integers(3, 30))) for _ in range(200)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        shard_dataset([str(tmp_path / f"{name}.jsonl")], str(tmp_path / name), tokenizer="bytes",
                      shard_tokens=1000, val_fraction=0.0, progress=False, log=lambda m: None)
    blend_datasets([(str(tmp_path / "a"), "0.5"), (str(tmp_path / "b"), "0.5")], str(tmp_path / "mix"),
                   seed=1)
    mix = open_split(str(tmp_path / "mix"), "train", 16)
    comps = [TokenShards(str(tmp_path / n), "train", 16) for n in "ab"]
    indices = np.arange(0, len(mix), 7)
    got = mix.document_ids(indices)
    for row, i in enumerate(indices.tolist()):
        c, j = mix.locate(i)
        assert got[row].tolist() == comps[c].document_ids([j])[0].tolist()
        eot = np.flatnonzero(comps[c].window(j)[:-1] == comps[c].eot_id)  # a new document follows
        assert got[row].tolist() == np.cumsum(np.isin(np.arange(17), eot + 1)).tolist()
    assert got.max() >= 1


def test_window_inside_a_document_and_positions_from_ids():
    out = np.empty(6, dtype=np.int64)
    window_doc_ids(np.array([0, 10, 13, 40]), 9, 6, out)  # tokens 9..14: doc starts at 10 and 13
    assert out.tolist() == [0, 1, 1, 1, 2, 2]
    window_doc_ids(np.array([0, 40]), 12, 6, out)  # wholly inside one document
    assert out.tolist() == [0] * 6
    assert positions_in_documents(np.array([[0, 1, 1, 1, 2, 2]])).tolist() == [[0, 0, 1, 2, 0, 1]]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "deepseek_v3"])
def test_packed_window_losses_equal_each_document_alone(arch, packed):
    model = build(arch)
    inputs, keywords, targets = model_inputs(packed)
    with torch.no_grad():
        got = per_token_losses(model(inputs, **keywords), targets)
        unmasked = per_token_losses(model(inputs), targets)
        alone, start = [], 0
        for n in (*DOC_LENGTHS[:3], SECTION["block_size"] - sum(DOC_LENGTHS[:3])):
            alone.append(per_token_losses(model(inputs[:, start:start + n]), targets[:, start:start + n]))
            start += n
    want = torch.cat(alone)
    assert (got - want).abs().max().item() <= 1e-5
    assert (unmasked - want).abs().max().item() > 1e-3  # documents 1-3 see their predecessors


def test_rope_families_match_without_restarting_positions(packed):
    """Rotary attention is relative: masking alone already gives each document's own losses."""
    model = build("llama")
    inputs, keywords, targets = model_inputs(packed._replace(positions=None))
    assert set(keywords) == {"doc_ids"}
    with torch.no_grad():
        got = per_token_losses(model(inputs, **keywords), targets)
        n = DOC_LENGTHS[0]
        second = per_token_losses(model(inputs[:, n:n + DOC_LENGTHS[1]]), targets[:, n:n + DOC_LENGTHS[1]])
    assert (got[n:n + DOC_LENGTHS[1]] - second).abs().max().item() <= 1e-5


def test_without_document_ids_it_is_sdpa_is_causal_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    assert torch.equal(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    one_doc = torch.zeros(2, 16, dtype=torch.long)  # a single document: the causal mask itself
    assert (causal_attention(q, k, v, one_doc) - causal_attention(q, k, v)).abs().max() <= 1e-6


def test_plain_micro_batch_passes_no_keywords():
    tokens = torch.arange(10).view(2, 5)
    inputs, keywords, targets = model_inputs(tokens)
    assert keywords == {} and inputs.tolist() == tokens[:, :-1].tolist()
    batch = DocumentBatch(tokens, torch.zeros_like(tokens), None)
    assert set(model_inputs(batch)[1]) == {"doc_ids"}


@pytest.mark.parametrize("overrides, key", [
    (["--data.document_positions=true"], "data.document_positions"),
])
def test_config_refusals_are_one_line(tmp_path, overrides, key):
    cfg, _ = write_config(tmp_path, tmp_path)
    load(cfg, [])  # the template itself is valid
    with pytest.raises(ConfigError) as e:
        load(cfg, overrides)
    assert str(e.value).startswith(f"config key '{key}'") and "\n" not in str(e.value)


def test_pipeline_parallelism_takes_document_masking(tmp_path):
    """Every stage gets the ids (parallel/runner.py; tests/mpi/test_document_mask_mpi.py)."""
    cfg, _ = write_config(tmp_path, tmp_path)
    loaded = load(cfg, ["--data.document_mask=true", "--data.document_positions=true",
                        "--parallel.pp=2"])
    assert (loaded.parallel.pp, loaded.data.document_mask, loaded.data.document_positions) == (2, True, True)
