"""hpctrain/evaluate.py's pure parts: which windows a rank takes, how many bytes tokens are."""
from __future__ import annotations

import numpy as np
import pytest

from data_tools.tokenizers import BytesTokenizer, GPT2Tokenizer
from hpctrain.evaluate import token_byte_lengths, window_indices

TEXT = "Ümlaut naïve café — 東京 👩‍🔬 tabs\t\tand  spaces 12345.\n"


@pytest.mark.parametrize("tokenizer", [GPT2Tokenizer(), BytesTokenizer()], ids=["gpt2", "bytes"])
def test_the_bytes_of_a_text_s_tokens_are_its_utf8_bytes(tokenizer):
    """Multi-byte characters split across GPT-2 tokens (the emoji, the CJK) still add up exactly;
    the end-of-text token counts no byte."""
    ids = np.concatenate([tokenizer.encode(TEXT), [tokenizer.eot_id], tokenizer.encode(TEXT)])
    lengths = token_byte_lengths(tokenizer, tokenizer.vocab_size + 47)  # a padded embedding
    assert int(lengths[ids].sum()) == 2 * len(TEXT.encode("utf-8"))
    assert lengths[tokenizer.eot_id] == 0 and lengths[tokenizer.vocab_size:].sum() == 0


@pytest.mark.parametrize("wanted", [0, 7])
def test_ranks_take_each_window_once(wanted):
    every = np.concatenate([window_indices(50, wanted, r, 3) for r in range(3)])
    want = np.linspace(0, 49, wanted).astype(np.int64) if wanted else np.arange(50)
    assert sorted(every.tolist()) == sorted(want.tolist())
