"""The tiktoken engines for tokenizer.json files (data_tools/fast_bpe.py, fast_spm.py; #32):
ids identical to ``tokenizers.Tokenizer.encode`` on real text, for tokenizers trained HERE
(`train-tokenizer`'s, Llama-3-style Split regex + specials, GPT-2-style ByteLevel regex, one
with added tokens that occur in the text; SentencePiece-style BPE with byte fallback shaped as
Llama 2's, Mistral's, and Metaspace split), and a file it gets wrong is caught on the corpus
sample and sharded by the library instead, with one warning line."""
import glob
import json
import os
import sys

import numpy as np
import pytest

from bench.shard_tokenizers import sentencepiece_bpe_spec
from data_tools.tokenizers import get_tokenizer
from tests.conftest import run_cmd
from tests.tokenizer_files import LLAMA3_PAT, LLAMA3_SPECIALS
from tests.tokenizer_files import plays as _plays
from tests.tokenizer_files import shard as _shard
from tests.tokenizer_files import tokens as _tokens

# Unicode, whitespace runs, tabs, CRLF, digits, contractions and special-token text after spaces.
STRESS = ("  Ünïcödé naïve café — 日本語のテキスト 中文 한국어 🎉🎉 👨‍👩‍👧 e\u0301 \u00a0nbsp\u2003em\n"
          "\t\ttabs\t \r\n\r\n   \n\n\n    trailing   \n 1234567 3.14159 I'LL we've DON'T 's 'd\n"
          "x <|end_of_text|> y<|begin_of_text|>\n <|eot_id|><|eot_id|>  <|endoftext|> KING HENRY."
          " KING HENRYS thee,thee athee <|end_of_text|")


def _python_sources():
    """Another real corpus beside Shakespeare: Python's own standard library sources."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    return [open(f, encoding="utf-8").read() for f in files]


@pytest.fixture(scope="module")
def corpus():
    plays = _plays(42)
    return [plays[20], plays[7][:60000], STRESS * 3] + _python_sources()


def _train(pre_tokenizer, ignore_merges, specials, texts, added=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if added:
        tok.add_tokens(list(added))
    return tok


def _llama3(texts, added=()):
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # special-token text in the training text: merges such as ' <|' exist
    return _train(pre, True, LLAMA3_SPECIALS, texts + [STRESS] * 50, added)


def _gpt2_style(texts):
    from tokenizers import pre_tokenizers

    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), False, ["<|endoftext|>"], texts)


def _with_added(texts):
    from tokenizers import AddedToken

    return _llama3(texts, added=[AddedToken("KING HENRY", normalized=False), "thee", "▁new▁",
                                 AddedToken("<|end", normalized=False)])


def _train_tokenizer_cli(texts, tmp):
    from data_tools.train_tokenizer import train_tokenizer

    for i, t in enumerate(texts):
        (tmp / f"{i}.txt").write_text(t, encoding="utf-8")
    out = train_tokenizer([str(tmp)], str(tmp / "tok" / "tokenizer.json"), vocab_size=4000)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(out["path"])


@pytest.mark.parametrize("kind", ["train-tokenizer", "llama3", "gpt2-style", "added-tokens"])
def test_ids_identical_to_the_tokenizers_library(kind, corpus, tmp_path):
    train = _plays(4) + _python_sources()[:20]
    build = {"llama3": _llama3, "gpt2-style": _gpt2_style, "added-tokens": _with_added,
             "train-tokenizer": lambda t: _train_tokenizer_cli(t, tmp_path)}[kind]
    lib = build(train)
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = get_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.engine == "tiktoken", kind
    lib.encode_special_tokens = True
    fast = tok.encode_batch(corpus, num_threads=2)
    assert tok.fast is not None  # the corpus sample agreed
    total = 0
    for text, ids in zip(corpus, fast):
        want = lib.encode(text, add_special_tokens=False).ids
        assert ids.tolist() == want, (kind, text[:80])
        total += len(want)
    assert total > 200_000
    if kind == "added-tokens":  # the added tokens are in the text and came out as their ids
        joined = np.concatenate(fast)
        for t in ("KING HENRY", "thee", "<|end"):
            assert (joined == lib.token_to_id(t)).sum() > 0, t
        assert lib.token_to_id("<|end_of_text|>") not in joined  # special text stays text


def _qua_tokenizer(ignore_merges):
    """'qua' built by the merge q+ua, not qu+a: in 'quack' the library gives [qu, a, ...],
    tiktoken (which merges any pair that makes a token) [qua, ...]; in 'qua' alone, without
    ignore_merges, the library gives [qu, a] and tiktoken's whole-piece lookup [qua]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("q", "u"), ("u", "a"), ("q", "ua")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    lib = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.add_special_tokens(["<|endoftext|>"])
    return lib, vocab


def test_a_file_tiktoken_gets_wrong_is_caught_on_the_corpus_and_sharded_by_the_library(tmp_path):
    """The load probe has no 'qu'; the corpus sample does: one warning, the library's ids."""
    lib, vocab = _qua_tokenizer(ignore_merges=True)
    lib.save(str(tmp_path / "tokenizer.json"))
    assert get_tokenizer(str(tmp_path / "tokenizer.json")).engine == "tiktoken"
    docs = tmp_path / "docs.jsonl"
    texts = ["the duck said qua", "quack quack, aqua"]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    r = _shard([docs], tmp_path / "data", tmp_path / "tokenizer.json")
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "tokenizer.json" in warn[0] and "Traceback" not in r.stderr
    _, toks = _tokens(tmp_path / "data")
    eot = vocab["<|endoftext|>"]
    want = [i for t in texts for i in lib.encode(t, add_special_tokens=False).ids + [eot]]
    assert toks.tolist() == want and vocab["qua"] not in want and vocab["qu"] in want
    r = run_cmd([sys.executable, "-m", "data_tools", "verify", str(tmp_path / "data")])
    assert r.returncode == 0, r.stderr


def test_a_token_its_merges_do_not_build_keeps_the_library_at_load(tmp_path):
    """Without ignore_merges, 'qua' as a whole piece is [qu, a] in the library: checked on the
    vocabulary at load, whatever the corpus holds."""
    lib, vocab = _qua_tokenizer(ignore_merges=False)
    lib.save(str(tmp_path / "tokenizer.json"))
    tok = get_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.engine.startswith("tokenizers")  # the library (per word: word_cache.py), not tiktoken
    assert tok.encode("qua").tolist() == [vocab["qu"], vocab["a"]]


@pytest.mark.parametrize("shape", ["llama2", "mistral", "metaspace-split"])
def test_sentencepiece_style_ids_identical_to_the_library(shape, corpus, tmp_path):
    """Llama 2's shape (Prepend + Replace normalizer), Mistral's (Metaspace, prepend 'first', no
    split), Metaspace split. Characters the vocabulary lacks (Korean, emoji) go through byte
    fallback as '<0xNN>' tokens; spaces, a leading space, '▁' in the text itself."""
    from tokenizers import Tokenizer

    spec = sentencepiece_bpe_spec(_plays(4) + [STRESS[:40]], 3000, shape)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tok = get_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.engine == "tiktoken" and tok.eot_id == 2
    lib = Tokenizer.from_str(json.dumps(spec))
    lib.encode_special_tokens = True
    texts = corpus[:3] + [" lead", "  two", "▁x▁▁y ", "日本", ""] + corpus[3:25]
    fast = tok.encode_batch(texts, num_threads=2)
    assert tok.fast is not None
    want = [lib.encode(t, add_special_tokens=False).ids for t in texts]
    assert [ids.tolist() for ids in fast] == want
    emoji_byte = lib.token_to_id("<0xF0>")  # no emoji in the training text: byte fallback
    assert sum(map(len, want)) > 200_000 and emoji_byte in np.concatenate(fast)
