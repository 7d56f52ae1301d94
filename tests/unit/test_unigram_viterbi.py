"""data_tools/unigram_viterbi.py gives the tokenizers library's Unigram ids exactly (#32)."""
import itertools
import json

import numpy as np
import pytest

from data_tools import unigram_viterbi, word_cache as wc
from data_tools.corpora import shakespeare_files
from data_tools.unigram_viterbi import MAX_CHARS, UnigramViterbi

tokenizers = pytest.importorskip("tokenizers")

ADVERSARIAL = (["a" * n for n in range(1, MAX_CHARS + 1)] + ["ab" * 20, "ba" * 24, "aab", "aba"]
               + ["x", "xx", "axa", "😀", "😀😀a😀", "a😀b", "ё", "ёж", "日本語の文", "مرحبا", "é",
                  "e\u0301", "▁", "▁▁", "a▁b", "a▁▁b", "▁a▁", "  a", " a ", "a  b", " ", "   ",
                  "\u200b", "<unk>", "<unk><unk>", "\x00", "a\tb", "Ωmega", "ab" * 23 + "😀"])


def _reference(helper, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
    got = helper.encode(words, is_pretokenized=True, add_special_tokens=False)
    bounds = np.searchsorted(np.asarray(got.word_ids, dtype=np.int64), np.arange(len(words) + 1))
    return np.asarray(got.ids, dtype=np.uint32), bounds


def _check(spec: dict, words: list[str], prepend: bool = True) -> UnigramViterbi:
    helper = wc.piece_tokenizer(spec, prepend)
    fast = UnigramViterbi.from_tokenizer(helper, prepend)
    assert fast is not None
    words = [w for w in words if fast.covers(w)]
    ids, bounds = fast.encode_words(words)
    want, want_bounds = _reference(helper, words)
    for i, w in enumerate(words):  # the first word that differs, named
        assert ids[bounds[i]:bounds[i + 1]].tolist() == want[want_bounds[i]:want_bounds[i + 1]].tolist(), w
    assert np.array_equal(bounds, want_bounds)
    return fast


@pytest.fixture(scope="module")
def plays():
    return [open(f, encoding="utf-8").read() for f in shakespeare_files()]


@pytest.fixture(scope="module")
def bench_unigram(plays):
    """The bench's Unigram (bench/shard_tokenizers.py: 8,000 ids trained on 10 plays)."""
    sp = tokenizers.SentencePieceUnigramTokenizer()
    sp.train_from_iterator(plays[:10], vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"],
                           unk_token="<unk>", show_progress=False)
    return json.loads(sp.to_str())


@pytest.mark.parametrize("dense", [True, False])
def test_every_word_of_the_plays_and_adversarial_strings(bench_unigram, plays, dense, monkeypatch):
    if not dense:  # the binary-search trie a large vocabulary takes
        monkeypatch.setattr(unigram_viterbi, "DENSE_MAX", 0)
    tok = tokenizers.Tokenizer.from_str(json.dumps(bench_unigram))
    white, prepend = wc.word_cuts(bench_unigram)
    words = sorted({w for p in plays for w in wc.cut_pattern(white).findall(p)})
    norm = wc.normalized(tok.normalizer.normalize_str, words)
    assert len(norm) > 80_000
    fast = _check(bench_unigram, norm + ADVERSARIAL, prepend)
    assert (fast.table is not None) == dense


def _spec(vocab: list, byte_fallback: bool = False, unk_id=0) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "Unigram", "unk_id": unk_id, "vocab": vocab,
                      "byte_fallback": byte_fallback}}


# ties: a+aa = aa+a = aaa exactly; 0.1 + 0.2 != 0.3 in float64 (one path wins by rounding)
TIES = [["<unk>", 0.0], ["▁", -1.0], ["a", -1.0], ["aa", -2.0], ["aaa", -3.0], ["b", -0.1],
        ["bb", -0.2], ["bbb", -0.30000000000000004], ["ab", -1.5], ["▁a", -1.5], ["c", -0.2],
        ["cc", -0.30000000000000004], ["ccc", -0.1 - 0.2 - 0.2], ["aa", -1.9], ["ё", -2.0]]


@pytest.mark.parametrize("prepend", [True, False])
def test_ties_repeats_and_unknowns_on_a_handmade_vocabulary(prepend):
    words = ADVERSARIAL + ["".join(p) for p in itertools.product("abc▁ d", repeat=4)]
    words += ["bbbbbb", "cccccc", "aaaaaaa", "ddd", "dd dd", "😀😀😀", "ёёё", "aёdёa"]
    _check(_spec(TIES), words, prepend)


def test_byte_fallback_and_fused_unknowns():
    """byte_fallback: a fused unknown becomes its UTF-8 bytes where every <0xXX> piece exists
    (here all but 0x98: '😀' = F0 9F 98 80 stays the unk id), else the unk id."""
    vocab = TIES[:-2] + [[f"<0x{b:02X}>", -20.0] for b in range(256) if b != 0x98]
    assert tokenizers.models.Unigram([tuple(v) for v in vocab], 0, True)  # the library has it
    fast = _check(_spec(vocab, byte_fallback=True), ADVERSARIAL + ["dd", "ёd😀", "😀", "dёd"])
    assert fast.byte_fallback
    ids, _ = fast.encode_words(["dё", "😀"])
    at = {t: i for i, (t, _) in enumerate(vocab)}
    assert ids.tolist() == [at[t] for t in ("▁", "<0x64>", "<0xD1>", "<0x91>", "▁", "<unk>")]


def test_only_where_exact():
    """No unk id, an empty piece or a non-finite score: the library encodes (None); words
    longer than MAX_CHARS or empty are not covered."""
    assert UnigramViterbi.from_tokenizer(_tok(_spec(TIES, unk_id=None)), True) is None
    assert UnigramViterbi.from_tokenizer(_tok(_spec(TIES + [["", -1.0]])), True) is None
    fast = UnigramViterbi.from_tokenizer(_tok(_spec(TIES)), True)
    assert fast.covers("a" * MAX_CHARS) and not fast.covers("a" * (MAX_CHARS + 1))
    assert not fast.covers("")


def test_the_word_cache_uses_it_and_matches_the_library(bench_unigram, plays):
    """encode_new of word_cache.metaspace_words: our Viterbi for the words it covers, the
    library for the rest (a 60-character word, an empty one), same blobs as the library alone."""
    tok = tokenizers.Tokenizer.from_str(json.dumps(bench_unigram))
    white, prepend = wc.word_cuts(bench_unigram)
    words = wc.cut_pattern(white).findall(plays[3][:200_000]) + ["\x1c", " " + "z" * 60, " the"]
    got = wc.metaspace_words(tok, bench_unigram, prepend)(words)
    want = [np.array(tok.encode(w, add_special_tokens=False).ids, np.uint32).tobytes()
            for w in words[-400:]]
    assert got[-400:] == want


def _tok(spec):
    return tokenizers.Tokenizer.from_str(json.dumps(spec))
