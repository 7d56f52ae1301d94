"""``validate`` and ``shard --filter``: document quality filters and the report of what they drop.

Owns: the filter rules — a document is dropped if it is not valid UTF-8 (or, in JSONL, not a JSON
object with a string ``text``), empty or whitespace-only, shorter than ``min_chars`` characters
after stripping, or an exact duplicate (sha256 of its text) of an EARLIER document in the global
order (the first occurrence is kept) — applied in parallel: each rank scans a contiguous range,
rank 0 decides duplicates in document order, so the kept set never depends on the rank count.

Must never: modify inputs, tokenize, or decide the train/val split (the sharder numbers the KEPT
documents 0..N-1 and applies its split rule to them).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from . import documents
from .format import DataError
from .mpiutil import SerialComm, agree

DEFAULT_MIN_CHARS = 1
REASONS = ("invalid", "empty", "short", "duplicate")


def _scan(table, lo: int, hi: int, min_chars: int) -> tuple[list, list]:
    """(reason or None, sha256 digest or None) for documents [lo, hi)."""
    reasons, digests = [], []
    handle, handle_idx, rows = None, -1, None
    try:
        for i in range(lo, hi):
            fi = int(table.file_idx[i])
            if table.parquet and table.parquet[fi]:  # Arrow does not check UTF-8: the reader does
                from .parquet import InvalidText, RowReader

                if rows is None or rows.path != table.files[fi]:
                    rows = RowReader(table.files[fi], table.text_column)
                try:
                    raw = rows.text(int(table.offset[i])).encode("utf-8")
                except InvalidText:
                    raw = b"\xff"  # counted "invalid" below, as a text file's bad UTF-8 is
                fi = -1
            elif fi != handle_idx:
                if handle is not None:
                    handle.close()
                handle, handle_idx = open(table.files[fi], "rb"), fi
            if fi >= 0:
                handle.seek(int(table.offset[i]))
                raw = handle.read(int(table.length[i])) if table.jsonl[fi] else handle.read()
            try:
                text = raw.decode("utf-8")
                if fi >= 0 and table.jsonl[fi]:
                    obj = json.loads(text)
                    text = obj["text"] if isinstance(obj, dict) else None
                    if not isinstance(text, str):
                        raise ValueError("no string 'text'")
            except (UnicodeDecodeError, ValueError, KeyError, RecursionError):
                reasons.append("invalid")
                digests.append(None)
                continue
            stripped = text.strip()
            reason = "empty" if not stripped else "short" if len(stripped) < min_chars else None
            reasons.append(reason)
            digests.append(hashlib.sha256(text.encode("utf-8")).digest() if reason is None else None)
    finally:
        if handle is not None:
            handle.close()
    return reasons, digests


def filter_documents(table, min_chars: int = DEFAULT_MIN_CHARS, comm=None) -> tuple[np.ndarray, dict]:
    """Boolean keep-mask over ``table`` and a report {reason: count, kept, total, examples}.
    Every rank of ``comm`` must call it; all get the same result."""
    comm = comm if comm is not None else SerialComm()
    lo, hi = documents.balanced_ranges(table.length, comm.Get_size())[comm.Get_rank()]
    parts = comm.gather(agree(comm, _scan, table, lo, hi, int(min_chars)), root=0)

    def decide():
        if comm.Get_rank() != 0:
            return None
        reasons = [r for part in parts for r in part[0]]
        digests = [d for part in parts for d in part[1]]
        seen, keep = set(), np.ones(len(reasons), dtype=bool)
        report = {r: 0 for r in REASONS}
        examples = {}
        for i, (reason, digest) in enumerate(zip(reasons, digests)):
            if reason is None and digest in seen:
                reason = "duplicate"
            if reason is None:
                seen.add(digest)
                continue
            keep[i] = False
            report[reason] += 1
            where = table.files[int(table.file_idx[i])]
            examples.setdefault(reason, f"{where}:{int(table.line[i])}" if table.line[i] else where)
        report.update(total=len(reasons), kept=int(keep.sum()), examples=examples)
        if not keep.any():
            raise DataError(table.files[0], "every document was dropped by the filters")
        return keep, report

    return comm.bcast(agree(comm, decide), root=0)


def subset(table, keep: np.ndarray):
    """The document table restricted to ``keep`` (renumbered 0..N-1, same order)."""
    return documents.DocumentTable(table.files, table.jsonl, table.file_idx[keep],
                                   table.offset[keep], table.length[keep], table.line[keep],
                                   table.parquet, table.text_column)


def describe_report(report: dict, min_chars: int) -> str:
    dropped = report["total"] - report["kept"]
    lines = [f"{report['total']} documents: kept {report['kept']}, dropped {dropped}"]
    labels = {"invalid": "not UTF-8 / malformed JSONL", "empty": "empty or whitespace-only",
              "short": f"shorter than {min_chars} characters", "duplicate": "exact duplicates"}
    for r in REASONS:
        ex = report["examples"].get(r)
        lines.append(f"  {labels[r]:30s} {report[r]:8d}" + (f"   e.g. {ex}" if ex else ""))
    return "\n".join(lines)
