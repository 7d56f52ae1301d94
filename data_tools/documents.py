"""Documents: enumerating them from the inputs, reading their text, and the train/val split rule.

Owns: the ONE global deterministic document order (inputs in the order given; directories
walked recursively in sorted order), the document table (file, byte offset, byte length, line),
reading a document's text, the split hash, and balancing contiguous document ranges over ranks.

Must never: tokenize, write files, or depend on the number of MPI ranks for anything except
``balanced_ranges`` (which only decides who does the work, never what the output is).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .format import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIX = ".jsonl"
PARQUET_SUFFIX = ".parquet"  # one document per row, in a text column (parquet.py)
DEFAULT_SUFFIXES = TEXT_SUFFIXES + (JSONL_SUFFIX, PARQUET_SUFFIX)


@dataclass
class DocumentTable:
    """Document i is bytes [offset[i], offset[i]+length[i]) of files[file_idx[i]].

    ``line[i]`` is the 1-based JSONL line number, 0 for a whole-file text document; for a
    Parquet file (``parquet[file]``) ``offset[i]`` is the row and ``length[i]`` its UTF-8 bytes.
    """
    files: list
    jsonl: list  # per file: True if JSON Lines
    file_idx: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    line: np.ndarray
    parquet: list = None  # per file: True if Parquet (None: no Parquet input)
    text_column: str = "text"
    chat: str = ""  # --format chat / preference: a JSONL line's document is its checked
    # "messages" list / its pair (data_tools/preference.py); "": plain text

    def __len__(self) -> int:
        return int(self.file_idx.size)


def _walk(root: str, suffixes=DEFAULT_SUFFIXES) -> list[str]:
    """Files under ``root`` with an accepted suffix, recursive, hidden entries skipped, sorted
    by their path relative to ``root`` (so the order never depends on the file system)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.endswith(tuple(suffixes)):
                full = os.path.join(dirpath, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return [full for _, full in sorted(found)]


def parse_extensions(spec) -> tuple:
    """``--extensions .py,.txt`` (or a list) -> ('.py', '.txt'); None -> the default suffixes."""
    if spec is None:
        return DEFAULT_SUFFIXES
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    exts = tuple(e if e.startswith(".") else "." + e for e in (x.strip() for x in items) if e)
    if not exts:
        raise DataError("--extensions", f"no file extension given in {spec!r} (e.g. .py,.txt)")
    return exts


def expand_inputs(inputs: list[str], extensions=None) -> list[str]:
    """Input paths -> list of files, in the global document order."""
    files, suffixes = [], parse_extensions(extensions)
    for path in inputs:
        if os.path.isdir(path):
            sub = _walk(path, suffixes)
            if not sub:
                hint = "" if extensions else "; choose others with --extensions (e.g. .py,.txt)"
                raise DataError(path, f"directory has no {'/'.join(suffixes)} files{hint}")
            files.extend(sub)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise DataError(path, "no such file or directory")
    return files


def enumerate_documents(inputs: list[str], extensions=None, text_column="text") -> DocumentTable:
    """Scan the inputs (JSONL files are read line by line, not parsed; Parquet files' text
    column is read for its lengths) into a DocumentTable."""
    files = expand_inputs(inputs, extensions)
    jsonl = [f.endswith(JSONL_SUFFIX) for f in files]
    parquet = [f.endswith(PARQUET_SUFFIX) for f in files]
    fidx, offs, lens, lines = [], [], [], []
    for i, (path, is_jsonl) in enumerate(zip(files, jsonl)):
        if parquet[i]:
            from .parquet import row_lengths

            n = row_lengths(path, text_column)
            fidx.extend([i] * n.size), offs.extend(range(n.size)), lens.extend(n.tolist())
            lines.extend([0] * n.size)
            continue
        if not is_jsonl:
            fidx.append(i), offs.append(0), lens.append(os.path.getsize(path)), lines.append(0)
            continue
        pos = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():  # blank lines are not documents
                    fidx.append(i), offs.append(pos), lens.append(len(raw)), lines.append(lineno)
                pos += len(raw)
    if not fidx:
        raise DataError(inputs[0] if inputs else "inputs", "no documents found")
    return DocumentTable(files, jsonl, np.asarray(fidx, np.int64), np.asarray(offs, np.int64),
                         np.asarray(lens, np.int64), np.asarray(lines, np.int64),
                         parquet if any(parquet) else None, text_column)


def where(table: DocumentTable, i: int) -> str:
    """Document i for a message: ``file``, ``file:line`` (JSONL) or ``file row N`` (Parquet)."""
    fi = int(table.file_idx[i])
    if table.parquet and table.parquet[fi]:
        return f"{table.files[fi]} row {int(table.offset[i])}"
    return f"{table.files[fi]}:{int(table.line[i])}" if table.jsonl[fi] else table.files[fi]


def iter_texts(table: DocumentTable, start: int, end: int):
    """Yield (doc_index, text) for documents [start, end) in order.  Raises DataError naming
    ``file``, ``file:line`` or ``file row N`` for undecodable text, bad JSON, a line without
    ``text``, or memory running out while reading it.  Holds no text between two documents."""
    handle, handle_idx, rows = None, -1, None
    try:
        for i in range(start, end):
            fi = int(table.file_idx[i])
            path = table.files[fi]
            if table.parquet and table.parquet[fi]:
                from .parquet import RowReader

                if rows is None or rows.path != path:
                    rows = RowReader(path, table.text_column)
                yield i, rows.text(int(table.offset[i]))
                continue
            if fi != handle_idx:
                if handle is not None:
                    handle.close()
                handle, handle_idx = open(path, "rb"), fi
            try:
                yield i, (_jsonl_text(handle, table, i) if table.jsonl[fi] else _file_text(handle, path))
            except MemoryError:
                raise DataError(where(table, i), f"out of memory reading it "
                                f"({int(table.length[i]) / 2 ** 20:,.0f} MiB): give the process "
                                f"more memory (docs/data.md: memory bound)") from None
    finally:
        if handle is not None:
            handle.close()


def _jsonl_text(handle, table: DocumentTable, i: int) -> str:
    """The ``text`` field of JSONL document i (its line at table.offset[i]); with ``table.chat``
    its ``messages`` list."""
    handle.seek(int(table.offset[i]))
    raw = handle.read(int(table.length[i]))
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise DataError(where(table, i), "invalid JSON (nested too deeply to parse)") from None
    except ValueError as e:
        raise DataError(where(table, i), f"invalid JSON ({e})") from None
    if table.chat:
        from .chat import conversation_of
        from .preference import preference_of

        parse = preference_of if table.chat == "preference" else conversation_of
        return parse(obj, where(table, i))
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise DataError(where(table, i), "JSONL line has no string 'text' field")
    return obj["text"]


def _file_text(handle, path: str) -> str:
    """A whole text file, decoded as UTF-8."""
    handle.seek(0)
    raw = handle.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, f"not valid UTF-8 (byte {e.start})") from None


# ----------------------------------------------------------------------------- split rule
_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (numpy array arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def split_uniforms(n_docs: int, seed: int) -> np.ndarray:
    """u_i in [0, 1) = splitmix64(splitmix64(seed) + i) >> 11, scaled by 2**-53."""
    key = _splitmix64(np.array([seed & _M64], dtype=np.uint64))
    h = _splitmix64(key + np.arange(n_docs, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)


def assign_val(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask: document i goes to val iff u_i < val_fraction.  Guarantees (when there
    are >= 2 documents and val_fraction > 0) at least one val document (the smallest u) and at
    least one train document (the largest u).  A single document always goes to train."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    u = split_uniforms(n_docs, seed)
    is_val = u < val_fraction
    if n_docs < 2 or val_fraction == 0.0:
        return np.zeros(n_docs, dtype=bool)
    if not is_val.any():
        is_val[int(np.argmin(u))] = True
    if is_val.all():
        is_val[int(np.argmax(u))] = False
    return is_val


def balanced_ranges(length: np.ndarray, n_parts: int) -> list[tuple[int, int]]:
    """Cut documents into ``n_parts`` contiguous ranges of roughly equal bytes (some may be
    empty).  Only decides which rank tokenizes what; the output never depends on it."""
    cum = np.concatenate([[0], np.cumsum(length, dtype=np.int64)])
    total = int(cum[-1])
    cuts = [0] + [int(np.searchsorted(cum, total * p // n_parts, side="left"))
                  for p in range(1, n_parts)] + [int(length.size)]
    cuts = np.maximum.accumulate(np.minimum(cuts, length.size)).tolist()
    return [(cuts[p], cuts[p + 1]) for p in range(n_parts)]
