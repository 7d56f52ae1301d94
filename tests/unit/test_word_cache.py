"""The per-word cache and the long-document pieces of tokenizer.json files (#32): a batch
encoded through pyarrow (and without it) gives exactly the library's ids, and a text is cut into
pieces only where the file's structure makes that exact, whatever one probe text says."""
import numpy as np
import pytest

from data_tools.hf_tokenizer import CHUNK_CHARS
from data_tools.tokenizers import get_tokenizer
from data_tools.word_cache import _arrow, chunks_are_exact
from tests.tokenizer_files import plays, shard, spm_bpe, tokens

# Each breaks a naive cut: an empty text, Nmt's U+200B -> space and dropped U+001C, the cache's
# own separator, repeated characters (Viterbi ties), no ASCII, controls first, spaces only.
EDGES = ["", "a\u200b b", "a\x1cb c  d", "\ue000x y\ue000 z", "aaa ... ---- zzzz", "日本語 テキスト b",
         "\x01\x02 b c", "  ", "end.\n", " lead", "x", "trail  \t"]


@pytest.fixture(scope="module")
def unigram(tmp_path_factory):
    from tokenizers import SentencePieceUnigramTokenizer

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(plays(2), vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                           unk_token="<unk>", show_progress=False)
    path = tmp_path_factory.mktemp("unigram") / "tokenizer.json"
    sp.save(str(path))
    return get_tokenizer(str(path))


def test_sentencepiece_style_unigram(unigram, tmp_path):
    """Mistral / Llama 2 style: Metaspace pre-tokenizer, Unigram model, </s> as end-of-text;
    sharded through the per-word cache (word-by-word is exact for this file)."""
    tok = unigram
    assert tok.name.startswith("unigram-") and tok.engine == "tokenizers, per-word cache"
    assert tok.eot_id == tok.tok.token_to_id("</s>")
    line = "Now is the winter of our discontent"
    assert tok.decode(tok.encode(line)).strip() == line
    (tmp_path / "a.txt").write_text(line)
    r = shard([tmp_path / "a.txt"], tmp_path / "data", tok.path)
    assert r.returncode == 0, r.stderr
    m, toks = tokens(tmp_path / "data")
    assert m["tokenizer"]["name"] == tok.name and toks.tolist() == tok.encode(line).tolist() + [tok.eot_id]


def test_a_batch_gives_the_library_ids_with_and_without_pyarrow(unigram):
    tok = unigram
    texts = EDGES[:6] + plays(8)[4:] + EDGES[6:] + [""]
    library = [tok.tok.encode(t, add_special_tokens=False).ids for t in texts]
    tok.fast.clear()
    assert tok.engine == "tokenizers, per-word cache" and tok.fast.arrow is not None
    assert [ids.tolist() for ids in tok.encode_batch(texts)] == library  # cold
    keys = list(tok.fast.blobs)
    assert len(keys) > 5000 and all(isinstance(k, bytes) for k in keys)  # pyarrow's words
    assert [ids.tolist() for ids in tok.encode_batch(texts[::-1])] == library[::-1]  # warm
    assert tok.encode_batch([]) == [] and tok.encode_batch([""])[0].size == 0
    tok.fast.clear()
    tok.fast.arrow = None  # no pyarrow installed: one regex pass and a lookup per word
    try:
        assert [ids.tolist() for ids in tok.encode_batch(texts)] == library
        assert len(tok.fast.blobs) > 5000 and all(isinstance(k, str) for k in tok.fast.blobs)
    finally:
        tok.fast.clear()
        tok.fast.arrow = _arrow()


def test_pieces_only_where_the_files_structure_makes_them_exact(tmp_path):
    """A Replace of 'o b' (across the space of 'to be'): the probe text has no 'o b', so the
    probe alone passed it; the file's structure says no, so long documents go whole."""
    tok = spm_bpe(tmp_path, {"type": "Replace", "pattern": {"String": "o b"}, "content": "0B"})
    assert tok.engine == "tokenizers" and tok.chunk_chars == 0 and not tok.chunks_exact
    text = "to be " * 3000  # cut before " be": 8192 is 2 mod 6
    assert tok.encode_batch([text])[0].tolist() == tok.tok.encode(text, add_special_tokens=False).ids
    tok.chunks_exact = True  # what the probe alone decided before
    assert tok._chunking_is_exact() == CHUNK_CHARS
    tok.chunk_chars = CHUNK_CHARS
    assert tok.encode_batch([text])[0].tolist() != tok.tok.encode(text, add_special_tokens=False).ids


META = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
NFKC, SPACES = {"type": "NFKC"}, {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}


@pytest.mark.parametrize("normalizer, pre, exact", [
    ({"type": "Sequence", "normalizers": [{"type": "Nmt"}, NFKC, SPACES]}, META, True),
    ({"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "StripAccents"}]}, META, True),
    (None, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, True),
    (None, {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, {"type": "Digits"}]}, True),
    (None, dict(META, split=False), False),  # one pre-token per text: the model sees it whole
    ({"type": "Prepend", "prepend": "▁"}, META, False),  # at every piece's start
    ({"type": "Strip", "left": True, "right": True}, META, False),
    ({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}, {"type": "WhitespaceSplit"},
     False),  # a space made '▁' is no longer split at
    (None, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}, False),
    (None, {"type": "Split", "pattern": {"Regex": ".{3}"}, "behavior": "Isolated"}, False),
    (None, None, False),
])
def test_chunks_are_exact_by_structure(normalizer, pre, exact):
    spec = {"normalizer": normalizer, "pre_tokenizer": pre, "model": {"type": "Unigram"},
            "added_tokens": [{"content": "</s>", "special": True}]}
    assert chunks_are_exact(spec) is exact
    spec["added_tokens"].append({"content": "a b", "special": False, "normalized": False})
    assert chunks_are_exact(spec) is False  # a token that spans the cut
