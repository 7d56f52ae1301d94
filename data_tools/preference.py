"""Preference data (``shard --format preference``): pairs of completions of one prompt, the chosen
and the rejected, for DPO (hpctrain/train/dpo.py).

A JSONL line is TRL's conversational preference row: ``{"prompt": [messages], "chosen":
[messages], "rejected": [messages]}``; a string prompt is one user message, a string completion
one assistant message.  Each side is rendered as ``prompt + completion`` with the tokenizer's own
chat template (data_tools/chat.py's renderer) and its loss mask marks the completion's assistant
turns only (never the prompt's).  One pair is ONE document of the shards:

    chosen ids, end-of-text, rejected ids, end-of-text        (mask 1 on completion tokens)

so a pair keeps one document number (one train/val split, one sample index) and the reader
(hpctrain/data/pairs.py) cuts it at its first end-of-text.  The layout is a chat dataset's
(format_version 2, tokens + loss_mask) with the manifest's ``"format": "preference"``.

Must never: read files other than the tokenizer's folder, write anything, or let a pair's end-of-
text id occur inside a rendered side (chat.py refuses that).
"""
from __future__ import annotations

import numpy as np

from .chat import ChatError, ChatTokenizer, conversation_of, pack
from .format import DataError

SIDES = ("chosen", "rejected")


def _messages(value, role: str, key: str, where: str) -> list[dict]:
    """A row's ``key`` as a checked message list (a string: one message of ``role``)."""
    msgs = [{"role": role, "content": value}] if isinstance(value, str) else value
    if not isinstance(msgs, list) or not msgs:
        raise DataError(where, f"'{key}' is neither a string nor a non-empty list of messages "
                               f"(--format preference)")
    return conversation_of({"messages": msgs}, f"{where} ({key})")


def preference_of(obj, where: str) -> dict:
    """The checked pair of one JSONL line: {"prompt", "chosen", "rejected"} as message lists, each
    completion holding an assistant turn.  Raises DataError naming ``where`` (file:line)."""
    if not isinstance(obj, dict) or any(k not in obj for k in ("prompt", *SIDES)):
        raise DataError(where, "JSONL line needs 'prompt', 'chosen' and 'rejected' "
                               "(--format preference)")
    pair = {"prompt": _messages(obj["prompt"], "user", "prompt", where)}
    for side in SIDES:
        pair[side] = _messages(obj[side], "assistant", side, where)
        if not any(m["role"] == "assistant" for m in pair[side]):
            raise DataError(where, f"'{side}' has no assistant message: nothing to prefer")
    return pair


class PreferenceTokenizer(ChatTokenizer):
    """A ChatTokenizer whose documents are pairs: chosen and rejected, each rendered after the
    prompt, joined by one end-of-text (the sharder adds the closing one)."""

    def encode_pair(self, pair: dict) -> np.ndarray:
        turn = len(pair["prompt"])
        sides = [self.encode_conversation(pair["prompt"] + pair[side], from_turn=turn)
                 for side in SIDES]
        return np.concatenate([sides[0], pack(np.asarray([self.eot_id]), np.zeros(1)), sides[1]])

    def encode_batch(self, pairs: list, num_threads: int = 1) -> list[np.ndarray]:
        out = []
        for j, pair in enumerate(pairs):
            try:
                out.append(self.encode_pair(pair))
            except ValueError as e:
                raise ChatError(j, str(e)) from None
        return out

    def __repr__(self) -> str:
        return f"<PreferenceTokenizer {self.name} vocab={self.vocab_size} eot={self.eot_id}>"
