"""``train-tokenizer``: train a byte-level BPE (HF ``tokenizers``) on the corpus, offline.

Owns: feeding the documents (same input rules and order as ``shard``) to
``ByteLevelBPETokenizer.train_from_iterator`` with ``<|endoftext|>`` as the only special token,
and writing ``tokenizer.json`` atomically.  ``shard --tokenizer PATH/tokenizer.json`` then uses it
(``data_tools.tokenizers.FileTokenizer``), copies it beside the shards and records its sha256 in
the manifest.

Must never: touch the network, or write anything but the one output file.
"""
from __future__ import annotations

import os

from . import documents
from .format import DataError, TMP_PREFIX
from .tokenizers import ENDOFTEXT

DEFAULT_VOCAB = 8192


def train_tokenizer(inputs: list[str], output: str, vocab_size: int = DEFAULT_VOCAB,
                    min_frequency: int = 2, extensions=None, text_column: str = "text") -> dict:
    """Train and save; returns {path, vocab_size, eot_id, documents}."""
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        raise DataError("tokenizers", "package not installed: pip install tokenizers") from None
    if vocab_size < 257 or vocab_size > 1 << 20:
        raise DataError("--vocab-size", f"must be in [257, 2**20], got {vocab_size}")
    if os.path.isdir(output) or not output.endswith(".json"):  # a directory: put it inside
        output = os.path.join(output, "tokenizer.json")
    table = documents.enumerate_documents(inputs, extensions=extensions, text_column=text_column)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator((t for _, t in documents.iter_texts(table, 0, len(table))),
                            vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=[ENDOFTEXT], show_progress=False,
                            length=len(table))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = os.path.join(os.path.dirname(os.path.abspath(output)),
                       f"{TMP_PREFIX}{os.getpid()}-{os.path.basename(output)}")
    tok.save(tmp)
    os.replace(tmp, output)
    return {"path": output, "vocab_size": tok.get_vocab_size(),
            "eot_id": tok.token_to_id(ENDOFTEXT), "documents": len(table)}
