"""`hpctrain export --format hf` writes tokenizer files with which
`AutoTokenizer.from_pretrained(OUT)` gives the ids the training shards hold (#48): for every class
export writes (GPT-2, Llama, Qwen2, Mixtral, Qwen2-MoE; a Mistral folder trains and exports as
Llama), on a document with digits, whitespace runs, non-ASCII text and the special tokens' literal
text. A shard's document is the text's ids (no BOS, special-token text as plain text) and then the
end-of-text id: `hf(text)["input_ids"] + [hf.eos_token_id]`.

Before: transformers 5 loads a Qwen2 export as Qwen2Tokenizer whatever tokenizer_config.json names,
rebuilding Qwen's pre-tokenizer from the vocabulary (digits one by one: more ids than trained on),
and every class took "<|end_of_text|>" in a text as the special id. Tokenizers trained here on
Shakespeare (tests/tokenizer_files.py) and GPT-2's genuine BPE; checkpoints made cheaply
(test_hf_import_export.save_run), exported in process.
"""
from __future__ import annotations

import json
import sys

import pytest

from data_tools.format import read_manifest
from data_tools.tokenizers import tokenizer_file_of
from hpctrain.export import export_hf
from tests.conftest import run_cmd
from tests.hf_models import OFFLINE
from tests.tokenizer_files import LLAMA3_PAT, LLAMA3_SPECIALS, plays, shard, spm_bpe, tokens
from tests.unit.test_hf_import_export import GPT2, LLAMA, MIXTRAL, QWEN2_MOE, save_run

TEXT = ("KING HENRY. Count 1234567 89 and 2024!\na    b\t\tc\n\n\n  naïve café 東京 😀 "
        "<|begin_of_text|> <|end_of_text|> <|eot_id|> <|endoftext|> <s> </s> <unk> end  ")
SMALL = {"vocab_size": 3072}  # a tokenizer trained here: 3000 ids
FAMILIES = {"gpt2": ({**GPT2, **SMALL}, "GPT2LMHeadModel"),
            "llama": ({**LLAMA, **SMALL}, "LlamaForCausalLM"),
            "qwen2": ({**LLAMA, **SMALL, "qkv_bias": True}, "Qwen2ForCausalLM"),
            "mixtral": ({**MIXTRAL, **SMALL}, "MixtralForCausalLM"),
            "qwen2_moe": ({**QWEN2_MOE, **SMALL}, "Qwen2MoeForCausalLM")}


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A Llama-3-style byte-level BPE (digits in threes, ignore_merges, special tokens) trained
    on three plays, with a tokenizer_config.json naming its eos as such datasets have."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(plays(3), trainer=trainers.BpeTrainer(
        vocab_size=3000, special_tokens=LLAMA3_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("byte_level")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    return sharded(d / "tokenizer.json", tmp_path_factory.mktemp("byte_level_data"))


@pytest.fixture(scope="module")
def gpt2_tok(tmp_path_factory):
    return sharded("gpt2", tmp_path_factory.mktemp("gpt2_data"))


def sharded(tokenizer, tmp):
    """(the checkpoint's tokenizer record, the shard's ids of TEXT: its ids + end-of-text)."""
    (tmp / "doc.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    r = shard([tmp / "doc.jsonl"], tmp / "data", tokenizer)
    assert r.returncode == 0, r.stderr
    m, ids = tokens(tmp / "data")
    record = dict(m["tokenizer"], **tokenizer_file_of(str(tmp / "data"), m))
    assert ids[-1] == record["eot_id"] and (ids == record["eot_id"]).sum() == 1
    return record, ids.tolist()


def exported(tmp_path, family: str, record: dict):
    section, arch = FAMILIES[family]
    if record["name"] == "gpt2":
        section = {**section, "vocab_size": 50304}
    save_run(tmp_path / "run", section, tokenizer=record)
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [arch]
    return tmp_path / "hf"


def auto_ids(folder, **kw):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kw)
    return hf(TEXT)["input_ids"] + [hf.eos_token_id], hf


@pytest.mark.parametrize("family", list(FAMILIES))
def test_autotokenizer_gives_the_shard_ids(family, byte_level, tmp_path):
    record, want = byte_level
    out = exported(tmp_path, family, record)
    got, hf = auto_ids(out)
    assert len(got) == len(want) and got == want, (type(hf).__name__, len(got), len(want))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["split_special_tokens"]
    assert hf.eos_token == "<|end_of_text|>" and hf.bos_token == "<|begin_of_text|>"
    assert hf.pad_token_id == hf.eos_token_id and hf(TEXT)["input_ids"][0] != hf.bos_token_id
    assert (out / "tokenizer.json").read_text() == record["files"]["tokenizer.json"]
    assert hf.decode(got[:-1]) == TEXT


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_gpt2_tokenizer_gives_the_shard_ids(family, gpt2_tok, tmp_path):
    """GPT-2's BPE: a tokenizer.json is built from its vocab.json + merges.txt (both still
    written). Before: Qwen2Tokenizer split "1234567" into 7 ids (GPT-2's regex: 3), and
    GPT2Tokenizer read "<|endoftext|>" in the text as id 50256."""
    record, want = gpt2_tok
    out = exported(tmp_path, family, record)
    got, hf = auto_ids(out)
    assert got == want, (type(hf).__name__, len(got), len(want))
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert hf.eos_token_id == 50256 and hf("Hello world")["input_ids"] == [15496, 995]


def test_qwen2_export_with_trust_remote_code(byte_level, tmp_path):
    """transformers 5 loads model_type qwen2's registered class whatever tokenizer_class says;
    the export's auto_map is what lets it read tokenizer.json: with trust_remote_code=True it
    names tokenization_hpctrain.py (the file as it is), without it PreTrainedTokenizerFast."""
    record, want = byte_level
    out = exported(tmp_path, "qwen2", record)
    code = ("import sys, json, transformers as t; h = t.AutoTokenizer.from_pretrained(sys.argv[1], "
            "trust_remote_code=True, local_files_only=True); "
            "print(json.dumps([type(h).__name__, h(sys.argv[2])['input_ids'] + [h.eos_token_id]]))")
    r = run_cmd([sys.executable, "-c", code, str(out), TEXT], timeout=120,
                env={**OFFLINE, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert r.returncode == 0, r.stderr[-2000:]
    name, got = json.loads(r.stdout.strip().splitlines()[-1])
    assert name == "HpctrainTokenizer" and got == want


def test_sentencepiece_style_tokenizer(tmp_path):
    """A Metaspace BPE (NFKC, <unk> for what it lacks): its unk and </s> come through too."""
    tok = spm_bpe(tmp_path)
    record, want = sharded(tok.path, tmp_path)
    assert tok.tok.token_to_id("<unk>") in want  # 東京 😀: not in three plays
    got, hf = auto_ids(exported(tmp_path / "x", "llama", record))
    assert got == want and hf.unk_token == "<unk>" and hf.eos_token == "</s>"


def test_a_post_processor_adding_bos_is_kept_with_one_warning(byte_level, tmp_path, capsys):
    """A tokenizer.json whose post_processor adds <|begin_of_text|> (Llama 3's) is exported as it
    is; the shards hold no BOS, so one warning line says add_special_tokens=False gives them."""
    import hashlib

    from data_tools.tokenizer_files import write_hf_tokenizer

    record, want = byte_level
    spec = json.loads(record["files"]["tokenizer.json"])
    bos = {"id": "<|begin_of_text|>", "ids": [spec["added_tokens"][0]["id"]], "tokens": ["<|begin_of_text|>"]}
    spec["post_processor"] = {"type": "TemplateProcessing", "special_tokens": {"<|begin_of_text|>": bos},
                              "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}]}
    text = json.dumps(spec)
    record = {**record, "sha256": hashlib.sha256(text.encode()).hexdigest(),
              "files": {**record["files"], "tokenizer.json": text}}
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    write_hf_tokenizer(record, "", str(tmp_path / "out"), model_type="llama")
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "adds <|begin_of_text|>" in err[0] and "add_special_tokens=False" in err[0]
    from transformers import AutoTokenizer

    (tmp_path / "out" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert hf(TEXT)["input_ids"] == [bos["ids"][0], *want[:-1]]
    assert hf(TEXT, add_special_tokens=False)["input_ids"] + [hf.eos_token_id] == want
