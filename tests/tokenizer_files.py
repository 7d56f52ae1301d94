"""What the tokenizer.json tests share: Llama 3's pre-tokenizer regex and special tokens, the
plays' text, sharding with a tokenizer (nothing held out), and a dataset's training tokens."""
import json
import os
import sys

import numpy as np

from data_tools.corpora import shakespeare_files
from data_tools.format import open_shard_layout, read_manifest, shards_of
from tests.conftest import run_cmd

# Llama 3's pre-tokenizer regex (as published in its tokenizer.json).
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def plays(n):
    return [open(f, encoding="utf-8").read() for f in shakespeare_files()[:n]]


def shard(inputs, out, tokenizer, *extra):
    return run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *map(str, inputs),
                    "--output", str(out), "--tokenizer", str(tokenizer), "--no-progress",
                    "--val-fraction", "0", *extra], timeout=300)


def tokens(data):
    m = read_manifest(str(data))
    out = []
    for e in shards_of(m, "train"):
        lay = open_shard_layout(os.path.join(str(data), e["file"]), e, m)
        out.append(np.fromfile(lay.path, dtype=lay.dtype, offset=lay.offset, count=lay.n_tokens))
    return m, np.concatenate(out)


def spm_bpe(tmp_path, normalizer=None):
    """A Metaspace BPE (NFKC, no byte fallback) trained on 3 plays, its normalizer replaced if
    given, saved in tmp_path, loaded as a sharding tokenizer."""
    from tokenizers import SentencePieceBPETokenizer

    from data_tools.tokenizers import get_tokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(plays(3), vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                           show_progress=False)
    spec = json.loads(sp._tokenizer.to_str())
    if normalizer is not None:
        spec["normalizer"] = normalizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return get_tokenizer(str(tmp_path / "tokenizer.json"))
