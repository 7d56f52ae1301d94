"""Any Hugging Face tokenizer.json in `data_tools shard` (#32), tokenizers trained HERE on
Shakespeare: a Llama-3-style byte-level BPE with special tokens, SentencePiece-style (Metaspace)
BPEs, and a 74k-word WordLevel vocabulary that needs uint32 shards; the tokenizer travels with
the dataset into a run, so `hpctrain sample` decodes with it unprompted (the Unigram:
test_word_cache.py)."""
import json
import shutil
import sys

import numpy as np
import pytest

from data_tools.format import DataError, read_manifest
from data_tools.tokenizers import get_tokenizer
from tests.conftest import TINY_TRAIN, run_cmd
from tests.tokenizer_files import LLAMA3_PAT, LLAMA3_SPECIALS
from tests.tokenizer_files import plays as _plays
from tests.tokenizer_files import shard as _shard
from tests.tokenizer_files import spm_bpe as _spm_bpe
from tests.tokenizer_files import tokens as _tokens

@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """A byte-level BPE built as Llama 3's is (Split regex + ByteLevel, ignore_merges, special
    tokens), with a tokenizer_config.json naming <|end_of_text|> as eos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_plays(6), trainer=trainer)
    d = tmp_path_factory.mktemp("llama3")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                         "eos_token": "<|end_of_text|>"}))
    return d


def test_llama3_style_special_tokens_eot_and_fast_path(llama3_dir, tmp_path):
    tok = get_tokenizer(str(llama3_dir / "tokenizer.json"))
    assert tok.eot_id == tok.tok.token_to_id("<|end_of_text|>") and tok.engine == "tiktoken"
    hamlet = _plays(42)[20]
    fast = tok.encode(hamlet)
    tok.fast = None  # the tokenizers library itself: the fast path must give the same ids
    assert np.array_equal(fast, tok.encode(hamlet)) and tok.decode(fast) == hamlet
    text = "a <|end_of_text|> b"  # special-token text in a document is plain text
    assert tok.eot_id not in tok.encode(text).tolist()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["To be, or not.", text]))
    r = _shard([docs], tmp_path / "data", llama3_dir / "tokenizer.json")
    assert r.returncode == 0, r.stderr
    m, toks = _tokens(tmp_path / "data")
    assert m["tokenizer"]["eot_id"] == tok.eot_id and m["dtype"] == "uint16"
    assert toks[toks == tok.eot_id].size == 2 and toks[-1] == tok.eot_id
    for name in ("tokenizer.json", "tokenizer_config.json"):  # it travels with the data
        assert (tmp_path / "data" / name).read_bytes() == (llama3_dir / name).read_bytes()
    r = _shard([docs], tmp_path / "d2", llama3_dir / "tokenizer.json", "--eot-token", "<|eot_id|>")
    assert r.returncode == 0 and read_manifest(str(tmp_path / "d2"))["tokenizer"]["eot_id"] == \
        tok.tok.token_to_id("<|eot_id|>")


def test_missing_eot_is_one_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("a b a")
    r = _shard([tmp_path / "doc.txt"], tmp_path / "data", tmp_path / "tokenizer.json")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "tokenizer.json" in lines[0]
    assert "--eot-token" in lines[0] and not (tmp_path / "data").exists()
    r = _shard([tmp_path / "doc.txt"], tmp_path / "data", tmp_path / "tokenizer.json", "--eot-id", "7")
    assert r.returncode == 1 and "--eot-id" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _shard([tmp_path / "doc.txt"], tmp_path / "data", "gpt2", "--eot-id", "1")
    assert r.returncode == 1 and "--eot-token/--eot-id" in r.stderr


def test_sparse_ids_size_the_vocabulary(tmp_path):
    """A vocabulary with holes (ids up to 70,000 among 4 tokens) is 70,001 ids: uint32 shards."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "to": 5, "be": 70000, "</s>": 9}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("to be or")
    r = _shard([tmp_path / "doc.txt"], tmp_path / "data", tmp_path / "tokenizer.json")
    assert r.returncode == 0, r.stderr
    m, toks = _tokens(tmp_path / "data")
    assert m["tokenizer"]["vocab_size"] == 70001 and m["dtype"] == "uint32"
    assert toks.tolist() == [5, 70000, 0, 9]


def test_sentencepiece_style_bpe_per_word_cache(tmp_path):
    """Metaspace BPE (NFKC, split at '▁', no byte fallback): no tiktoken form, but the file's
    structure makes word-by-word exact, so each distinct word goes through the library once."""
    tok = _spm_bpe(tmp_path)
    assert tok.engine == "tokenizers, per-word cache" and tok.eot_id == tok.tok.token_to_id("</s>")
    texts = [_plays(42)[20], "a\u200b b\x1c c  \n d\u00b4e e\u0301 </s>\t\tx", " lead", "trail  "]
    assert [ids.tolist() for ids in tok.encode_batch(texts)] == [ids.tolist() for ids in tok._slow_ids(texts)]
    assert len(tok.fast.blobs) > 1000


def test_sentencepiece_style_bpe_long_documents_in_pieces(tmp_path):
    """A Metaspace BPE whose normalizer the per-word cache does not accept (StripAccents): long
    documents are encoded in pieces cut before spaces (the library is ~2x faster so) only because
    that gives the whole document's ids."""
    from data_tools.hf_tokenizer import space_cuts

    tok = _spm_bpe(tmp_path, {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "StripAccents"}]})
    assert tok.chunk_chars > 0 and tok.engine == "tokenizers, long documents in pieces"
    hamlet = _plays(42)[20]
    assert len(space_cuts(hamlet, tok.chunk_chars)) > 10 and "".join(space_cuts(hamlet, 50)) == hamlet
    assert np.array_equal(tok.encode_batch([hamlet])[0], tok._slow_ids([hamlet])[0])


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory):
    """WordLevel over every whitespace-separated word of the 42 plays (74,315 + 2 ids): the
    words of the text sharded below get the highest ids (> 65,535)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    plays = _plays(42)
    late = set(plays[0].split())
    words = sorted({w for p in plays for w in p.split()} - late) + sorted(late)
    vocab = {w: i + 2 for i, w in enumerate(words)}
    vocab.update({"[UNK]": 0, "<|endoftext|>": 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = tmp_path_factory.mktemp("words")
    tok.save(str(d / "tokenizer.json"))
    (d / "play.txt").write_text(plays[0][:20000])
    return d


def test_uint32_round_trip_train_and_sample(words_dir, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    r = _shard([words_dir / "play.txt"], data, words_dir / "tokenizer.json")
    assert r.returncode == 0, r.stderr
    m, toks = _tokens(data)
    tok = get_tokenizer(str(words_dir / "tokenizer.json"))
    assert tok.vocab_size == 74317 and m["dtype"] == "uint32" and toks.dtype == np.uint32
    assert toks.max() < tok.vocab_size and (toks > 65535).mean() > 0.95  # ids that uint16 would wrap
    assert toks[:-1].tolist() == tok.encode((words_dir / "play.txt").read_text()).tolist()
    r = run_cmd([sys.executable, "-m", "data_tools", "verify", str(data)])
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "c.toml"
    blend = tmp_path / "blend"  # uint32 through a blend and the node cache too
    r = run_cmd([sys.executable, "-m", "data_tools", "blend", "--input", f"{data}:1", "--output", str(blend)])
    assert r.returncode == 0, r.stderr
    cfg.write_text(TINY_TRAIN.format(run=run, data=blend, steps=2).replace(
        "vocab_size = 257", "vocab_size = 74320").replace(
        f'path = "{blend}"', f'path = "{blend}"\ncache_dir = "{tmp_path / "cache"}"'))
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", str(cfg)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert any(p.name.endswith("train_00000.h5") for p in (tmp_path / "cache").rglob("*"))
    shutil.rmtree(data)  # the checkpoint carries the tokenizer: sample needs no dataset
    r = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", str(run), "--prompt",
                 "KING HENRY", "--tokens", "5"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()[-1].split()
    assert out[:2] == ["KING", "HENRY"] and len(out) == 7  # the words' own vocabulary, unprompted


def test_hf_tokenizer_files_load_in_transformers(llama3_dir, tmp_path):
    """What `export --format hf` writes: AutoTokenizer loads it offline with our ids and eos."""
    from transformers import AutoTokenizer

    from data_tools.tokenizer_files import write_hf_tokenizer
    from data_tools.tokenizers import tokenizer_file_of

    (tmp_path / "gpt2").mkdir()
    write_hf_tokenizer({"name": "gpt2", "eot_id": 50256}, "", str(tmp_path / "gpt2"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "gpt2"), local_files_only=True)
    assert hf("Hello world")["input_ids"] == [15496, 995] and hf.eos_token_id == 50256
    docs = tmp_path / "d.txt"
    docs.write_text("To be, or not to be")
    assert _shard([docs], tmp_path / "data", llama3_dir / "tokenizer.json").returncode == 0
    m = read_manifest(str(tmp_path / "data"))
    info = dict(m["tokenizer"], **tokenizer_file_of(str(tmp_path / "data"), m))
    shutil.rmtree(tmp_path / "data")  # the record carries the files
    (tmp_path / "out").mkdir()
    names = write_hf_tokenizer(info, str(tmp_path / "data"), str(tmp_path / "out"))
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (llama3_dir / "tokenizer.json").read_bytes()
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ours = get_tokenizer(str(llama3_dir / "tokenizer.json"))
    text = "Now is the winter of our discontent"
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text).tolist()
    assert hf.eos_token_id == ours.eot_id
