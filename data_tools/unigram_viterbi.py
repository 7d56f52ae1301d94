"""A Unigram segmentation of many distinct words at once in numpy, exact to the tokenizers library.

Owns: `UnigramViterbi` (the library's `Unigram.encode_optimized` + `tokenize`, tokenizers
0.2x, models/unigram/model.rs, vectorized over pieces): the vocabulary as a trie whose edges are
exact int64 keys (parent node * 0x110000 + code point) searched with `np.searchsorted`, all
pieces' matches found one length at a time, then the Viterbi run one end column at a time for
every piece together (pieces sorted by length, the active ones a prefix), then backtracked.

Exactness (the library's rules): positions step one character at a time; a candidate's score is
`piece score + best score of its start` in float64; at each end the candidates arrive by
increasing start (decreasing length) and only a strictly greater score replaces the one kept, so
a tie keeps the longest piece; a start with no one-character piece gets the unknown candidate
(score `min(vocab scores) - 10`); consecutive unknowns (or pieces whose id is unk_id) fuse into one token, which becomes its
vocabulary id if the fused text is a piece, else `<0xXX>` bytes under byte_fallback (all bytes
present), else unk_id. The scores are the library's own float64 values (its `to_str()`, written
shortest-round-trip). Words this does not cover (longer than MAX_CHARS, empty after the
normalizer, a vocabulary with an empty piece or a non-finite score, no unk_id) go to the library.
"""
from __future__ import annotations

import json

import numpy as np

SPACE = 0x2581  # '▁'
K = 0x110000  # code points: an edge key is parent * K + code point
DENSE_MAX = 1 << 23  # entries of the dense child table (64 MiB)
MAX_CHARS = 48  # longer words go to the library (bounds the per-column numpy calls;
# with the prepended "▁" and the longest piece, an end offset fits the uint8 it is kept in)
UNK_PENALTY = 10.0  # K_UNK_PENALTY in model.rs
CHUNK = 16384  # words per numpy pass


class UnigramViterbi:
    """`encode_words(normalized words) -> (uint32 ids, each word's first id index + total)` for
    the words `covers`; built from the library's serialized Unigram model."""

    def __init__(self, model: dict, prepend: bool):
        vocab = model["vocab"]
        self.prepend, self.unk_id = prepend, model.get("unk_id")
        self.byte_fallback = bool(model.get("byte_fallback"))
        self.ids = {t: i for i, (t, _) in enumerate(vocab)}  # the last id of a repeated piece
        scores = np.array([s for _, s in vocab], dtype=np.float64)
        self.unk_score = float(scores.min()) - UNK_PENALTY
        self._trie(scores)

    @classmethod
    def from_tokenizer(cls, tok, prepend: bool) -> "UnigramViterbi | None":
        """None where the model is not a plain Unigram this class reproduces exactly."""
        model = json.loads(tok.to_str()).get("model") or {}
        vocab = model.get("vocab") or []
        if (model.get("type") != "Unigram" or model.get("unk_id") is None or not vocab
                or any(t == "" for t, _ in vocab)
                or not np.isfinite(np.array([s for _, s in vocab], dtype=np.float64)).all()):
            return None
        return cls(model, prepend)

    def _trie(self, scores: np.ndarray) -> None:
        nodes, keys, child, term = {"": 0}, [], [], [-1]
        for tok, tid in self.ids.items():
            for n in range(1, len(tok) + 1):
                pre = tok[:n]
                if pre not in nodes:
                    nodes[pre] = len(nodes)
                    keys.append(nodes[tok[:n - 1]] * K + ord(tok[n - 1]))
                    child.append(nodes[pre])
                    term.append(-1)
            term[nodes[tok]] = tid
        order = np.argsort(np.array(keys, dtype=np.int64), kind="stable")
        self.keys = np.array(keys, dtype=np.int64)[order]
        self.child = np.array(child, dtype=np.int64)[order]
        self.term = np.array(term, dtype=np.int32)
        self.term_score = np.where(self.term >= 0, scores[np.maximum(self.term, 0)], -np.inf)
        self.max_len = max(map(len, self.ids))
        self._dense()

    def _dense(self) -> None:
        """A [node, character class] child table (-1: none) where it is small: a lookup is then
        one gather instead of a binary search."""
        self.table = None
        alphabet = np.unique(self.keys % K)
        if (self.term.size * (alphabet.size + 1) > DENSE_MAX
                or alphabet[-1] >= np.iinfo(np.int32).max):
            return
        self.cls = np.zeros(int(alphabet[-1]) + 1, dtype=np.int32)  # 0: no piece has it
        self.cls[alphabet] = np.arange(1, alphabet.size + 1)
        self.width = alphabet.size + 1
        table = np.full(self.term.size * self.width, -1, dtype=np.int32)
        table[self.keys // K * self.width + self.cls[self.keys % K]] = self.child
        self.table = table

    def _codes(self, chars: np.ndarray, pad: int) -> np.ndarray:
        """What `_step` takes per character (its class in the dense table, else the code
        point), `pad` zeros after the text."""
        if self.table is None:
            return np.append(chars.astype(np.int64), np.zeros(pad, np.int64))
        inside = chars < self.cls.size
        codes = np.zeros(chars.size + pad, dtype=np.int32)
        codes[:chars.size][inside] = self.cls[chars[inside]]
        return codes

    def _step(self, node: np.ndarray, code: np.ndarray) -> np.ndarray:
        """Each (node, next character's code)'s child node, -1 where none."""
        if self.table is not None:
            return self.table[node * self.width + code]
        key = node.astype(np.int64) * K + code
        i = np.minimum(np.searchsorted(self.keys, key), self.keys.size - 1)
        return np.where(self.keys[i] == key, self.child[i], -1).astype(np.int32)

    def covers(self, word: str) -> bool:
        return 0 < len(word) <= MAX_CHARS

    def encode_words(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `words` (each `covers`) through Metaspace (split, prepend as built) and the
        model, and where each word's ids start (len(words) + 1 bounds); CHUNK words at a time
        (the allocator then reuses the temporaries: 83.5k words, 0.04 s of page faults less)."""
        if len(words) > CHUNK:
            parts = [self._encode(words[i:i + CHUNK]) for i in range(0, len(words), CHUNK)]
            shift = np.cumsum([0] + [ids.size for ids, _ in parts])
            bounds = [b[:-1] + s for (_, b), s in zip(parts, shift)] + [shift[-1:]]
            return np.concatenate([ids for ids, _ in parts]), np.concatenate(bounds)
        return self._encode(words)

    def _encode(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        chars, word_starts = self._metaspace(words)
        piece = np.zeros(chars.size, bool)
        piece[word_starts[:-1]] = True
        piece |= chars == SPACE
        starts = np.flatnonzero(piece).astype(np.int32)
        lens = np.diff(np.append(starts, chars.size))
        matches = self._matches(chars, starts, lens)
        at, ids = self._viterbi(starts, lens, matches)
        ids, at = self._unknowns(chars, at, ids, starts)
        return ids, np.searchsorted(at, word_starts)

    def _metaspace(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The words' code points as Metaspace leaves them (' ' -> '▁', a '▁' prepended where
        the word does not start with one) and each word's first character (+ the total)."""
        if self.prepend:
            words = [w if w[:1] in (" ", "▁") else "▁" + w for w in words]
        chars = np.frombuffer("".join(words).encode("utf-32-le"), dtype=np.uint32).astype(np.int32)
        chars[chars == 32] = SPACE
        ends = np.cumsum(np.fromiter(map(len, words), np.int64, len(words)))
        return chars, np.concatenate([[0], ends])

    def _matches(self, chars, starts, lens) -> list:
        """Per piece length l (1, 2, ...): (start node, end offset in its piece, score, id) of
        every vocabulary piece of l characters in the text, each list
        sorted by end offset (the starts are visited by offset, so filtering keeps that order);
        length 1 also holds the unknown where no one-character piece starts."""
        piece = np.repeat(np.arange(starts.size, dtype=np.int32), lens)
        offset = (np.arange(chars.size, dtype=np.int32) - starts[piece]).astype(np.uint8)
        at = perm = np.argsort(offset, kind="stable").astype(np.int32)  # a radix sort
        rem = (lens[piece[at]] - offset[at]).astype(np.int32)  # characters left from each start
        node, out = np.zeros(at.size, dtype=np.int32), []
        width = min(self.max_len, int(lens.max()))
        codes = self._codes(chars, width)  # padded: a step past a piece's end is masked by rem
        for l in range(1, width + 1):
            node = self._step(node, codes[at + (l - 1)])
            hit = (node >= 0) & (rem >= l)
            at, node, rem = at[hit], node[hit], rem[hit]
            t = self.term[node]
            is_term = t >= 0
            if l == 1:  # every start: the one-character piece, else the unknown
                m, tid = perm, np.full(chars.size, -1, dtype=np.int32)
                score = np.full(chars.size, self.unk_score)
                tid[at[is_term]], score[at[is_term]] = t[is_term], self.term_score[node[is_term]]
                tid, score = tid[m], score[m]
            else:
                m, tid, score = at[is_term], t[is_term], self.term_score[node[is_term]]
            out.append((m + piece[m], offset[m] + l, score, tid))  # start node, end offset
            if at.size == 0:
                break
        return out

    def _viterbi(self, starts, lens, matches):
        """(each token's start character, its id or -1 for an unknown) in text order: the best
        path ends column by column, the candidates of a column by decreasing length (= the
        library's increasing start), a strictly greater score replacing the kept one."""
        best = np.full(starts.size + int(lens.sum()), -np.inf)
        back = np.zeros(best.size, dtype=np.int8)  # lengths <= MAX_CHARS + 1
        tids = np.zeros(best.size, dtype=np.int32)
        best[starts + np.arange(starts.size)] = 0.0
        cuts = [np.searchsorted(m[1], np.arange(int(lens.max()) + 2)) for m in matches]
        for j in range(1, int(lens.max()) + 1):
            for l in range(min(j, len(matches)), 0, -1):
                a, b = cuts[l - 1][j], cuts[l - 1][j + 1]
                if a == b:
                    continue
                start, _, score, tid = (x[a:b] for x in matches[l - 1])
                cand = best[start] + score
                end = start + l
                up = cand > best[end]
                end = end[up]
                best[end], back[end], tids[end] = cand[up], l, tid[up]
        return self._backtrack(starts, lens, back, tids)

    def _backtrack(self, starts, lens, back, tids):
        total = int(lens.sum())
        ids, has = np.zeros(total, dtype=np.int32), np.zeros(total, bool)
        k = np.arange(starts.size)
        off = lens.copy()
        while k.size:
            node = starts[k] + k + off
            l = back[node]
            off = off - l
            g = starts[k] + off
            ids[g], has[g] = tids[node], True
            keep = off > 0
            k, off = k[keep], off[keep]
        at = np.flatnonzero(has)
        return at, ids[at]

    def _unknowns(self, chars, at, ids, starts):
        """Consecutive unknowns in a piece fused and turned into ids as the library does (an
        unknown: a character no piece starts with, or the unk piece itself, e.g. '<unk>')."""
        unk = (ids < 0) | (ids == self.unk_id)
        if not unk.any():
            return ids.astype(np.uint32), at
        first = np.zeros(chars.size + 1, bool)
        first[starts] = True
        ends = np.append(at[1:], chars.size)  # the tokens cover the pieces end to end
        joined = unk.copy()
        joined[1:] &= unk[:-1] & ~first[at[1:]]
        joined[0] = False  # joined[i]: unknown i fuses with unknown i - 1
        run_start = np.flatnonzero(unk & ~joined)
        run_end = np.flatnonzero(unk & ~np.append(joined[1:], False)) + 1
        out_ids, out_at, last = [], [], 0
        for a, b in zip(run_start.tolist(), run_end.tolist()):
            text = chars[at[a]:ends[b - 1]].astype(np.uint32).tobytes().decode("utf-32-le")
            got = self._unknown_ids(text)
            out_ids += [ids[last:a], np.array(got, dtype=np.int64)]
            out_at += [at[last:a], np.full(len(got), at[a])]
            last = b
        out_ids.append(ids[last:])
        out_at.append(at[last:])
        return np.concatenate(out_ids).astype(np.uint32), np.concatenate(out_at)

    def _unknown_ids(self, text: str) -> list[int]:
        if text in self.ids:
            return [self.ids[text]]
        if self.byte_fallback:
            got = [self.ids.get(f"<0x{b:02X}>") for b in text.encode("utf-8")]
            if None not in got:
                return got
        return [self.unk_id]
