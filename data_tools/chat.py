"""Chat data (``shard --format chat``): conversations rendered with the tokenizer's own chat
template, tokenized, and a per-token loss mask (1 = an assistant turn's tokens).

Owns: checking a JSONL line's ``messages``, rendering a conversation exactly as transformers'
``apply_chat_template`` does (it IS transformers' renderer: ``AutoTokenizer`` loaded from the
tokenizer.json's folder, so its jinja environment, globals and special-token variables are the
ones a user gets), the assistant spans (by rendering prefixes of the conversation), and packing
ids + mask into one uint64 per token so the sharder's buffers and MPI exchange carry both.

Must never: read files other than the tokenizer's folder, write anything, or guess a template
(a tokenizer without one is an error).
"""
from __future__ import annotations

import os

import numpy as np

from .format import DataError

ROLES = ("system", "user", "assistant")
MASK_SHIFT = np.uint64(32)  # packed token = id | mask << 32 (ids < 2**32, the uint32 limit)
ID_BITS = np.uint64(0xFFFFFFFF)
CHAT_TEMPLATE_HELP = ("add a `chat_template` to tokenizer_config.json (or a chat_template.jinja) "
                      "beside it, or shard plain text with --format text")


def conversation_of(obj, where: str) -> list[dict]:
    """The ``messages`` of one JSONL line, checked: a non-empty list of {role, content} with a
    known role and string content.  Raises DataError naming ``where`` (file:line)."""
    msgs = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise DataError(where, "JSONL line has no non-empty 'messages' list (--format chat)")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise DataError(where, f"messages[{i}] is not an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise DataError(where, f"messages[{i}] has role {m.get('role')!r} (expected one of "
                                   f"{', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise DataError(where, f"messages[{i}] content is not a string")
    return msgs


def pack(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One uint64 per token: the id in the low 32 bits, the loss mask bit above them."""
    return np.asarray(ids, np.uint64) | (np.asarray(mask, np.uint64) << MASK_SHIFT)


def unpack(packed: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(token ids as ``dtype``, loss mask as uint8) of packed tokens."""
    return (packed & ID_BITS).astype(dtype), (packed >> MASK_SHIFT).astype(np.uint8)


class ChatError(Exception):
    """A conversation (number ``index`` of the batch) that cannot be sharded; the sharder names
    its file:line."""

    def __init__(self, index: int, problem: str):
        super().__init__(problem)
        self.index, self.problem = index, problem


class ChatTokenizer:
    """A tokenizer.json (its name, vocab_size, eot_id and file: ``base``) plus transformers'
    tokenizer of the same folder, which renders and encodes conversations."""

    packs_loss_mask = True

    def __init__(self, base):
        path = getattr(base, "path", None)
        if path is None or os.path.basename(path) != "tokenizer.json":
            raise DataError("--format chat", "needs --tokenizer DIR/tokenizer.json (the folder "
                                             "transformers loads, with its tokenizer_config.json)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError("transformers", "package not installed (renders chat templates): "
                                            "pip install transformers") from None
        folder = os.path.dirname(os.path.abspath(path))
        try:
            self.hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any load failure is a bad tokenizer folder
            raise DataError(folder, f"transformers cannot load it ({str(e).splitlines()[0][:200]})") from None
        if not self.hf.chat_template:
            raise DataError(path, f"has no chat template: {CHAT_TEMPLATE_HELP}")
        self.base = base
        self.name, self.vocab_size, self.eot_id = base.name, base.vocab_size, base.eot_id
        self.path, self.sha256 = base.path, base.sha256

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=generation_prompt)

    def assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the whole conversation rendered) the assistant turns
        make: from the end of the conversation before turn i rendered with the generation
        prompt, to the end of the conversation through turn i, trailing white space excluded
        (what a template's ``{% generation %}`` block around content + end-of-turn marks)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render(messages[:i], True) if i else ""
            upto = self.render(messages[:i + 1]).rstrip()
            if not (text.startswith(head) and text.startswith(upto) and len(upto) >= len(head)):
                raise ValueError(f"the chat template does not render messages[{i}] as a "
                                 f"continuation of the turns before it, so its tokens cannot "
                                 f"be told apart (a template that rewrites earlier turns)")
            spans.append((len(head), len(upto)))
        return spans

    def encode_conversation(self, messages: list[dict], from_turn: int = 0) -> np.ndarray:
        """Packed ids + loss mask of one conversation: the ids transformers'
        ``apply_chat_template(messages, tokenize=True)`` gives, mask 1 on tokens overlapping an
        assistant span (transformers' rule for its assistant mask) of messages[from_turn:]."""
        text = self.render(messages)
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], np.int64)
        if ids.size and np.any(ids == self.eot_id):
            raise ValueError(f"the end-of-text id {self.eot_id} occurs inside the rendered "
                             f"conversation: pick a separator the template never emits with "
                             f"--eot-token (e.g. <|endoftext|>)")
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], np.int64)
        ends = np.asarray([b for _, b in enc["offset_mapping"]], np.int64)
        mask = np.zeros(ids.size, np.uint8)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for turn, (a, b) in zip(turns, self.assistant_spans(messages, text)):
            if turn >= from_turn:
                mask[(starts < b) & (ends > a)] = 1
        return pack(ids, mask)

    @staticmethod
    def largest_id(packed: np.ndarray) -> int:
        """The largest token id of packed tokens (-1 for none)."""
        return int((packed & ID_BITS).max()) if packed.size else -1

    def encode_batch(self, conversations: list, num_threads: int = 1) -> list[np.ndarray]:
        out = []
        for j, messages in enumerate(conversations):
            try:
                out.append(self.encode_conversation(messages))
            except ValueError as e:
                raise ChatError(j, str(e)) from None
        return out

    def __repr__(self) -> str:
        return f"<ChatTokenizer {self.name} vocab={self.vocab_size} eot={self.eot_id}>"
