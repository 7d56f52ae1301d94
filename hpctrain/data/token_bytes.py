"""UTF-8 bytes of token ids, for bits per byte (`hpctrain eval`, training's [[eval]] sets): exact
per token for the genuine GPT-2 BPE (its tiktoken token bytes) and the bytes tokenizer, else each
window's predicted tokens decoded (a character cut by a window's edges counts as U+FFFD's 3 bytes).

Owns: counting bytes. It never reads shards or runs a model.
"""
from __future__ import annotations

import numpy as np
import torch


def token_byte_lengths(tokenizer, vocab_size: int) -> np.ndarray | None:
    """UTF-8 bytes of each token id (special tokens 0), where the tokenizer knows its tokens' bytes
    (the GPT-2 BPE, raw bytes); None otherwise."""
    from data_tools.tokenizers import BytesTokenizer, GPT2Tokenizer

    if isinstance(tokenizer, BytesTokenizer):
        lengths = np.ones(vocab_size, dtype=np.int64)
        lengths[256:] = 0
        return lengths
    if isinstance(tokenizer, GPT2Tokenizer):
        lengths = np.zeros(vocab_size, dtype=np.int64)
        for i in range(min(vocab_size, tokenizer.eot_id)):
            lengths[i] = len(tokenizer.enc.decode_single_token_bytes(i))
        return lengths
    return None


def target_bytes(targets: torch.Tensor, lengths: np.ndarray | None, tokenizer) -> int:
    """UTF-8 bytes of the predicted tokens `targets` [windows, T]: by `lengths` (each token's
    bytes, token_byte_lengths) where known, else each row decoded by `tokenizer`."""
    if lengths is not None:
        return int(lengths[targets.cpu().numpy()].sum())
    return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets.tolist())
