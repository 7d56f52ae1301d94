"""The study's journal file: Optuna's JournalFileBackend, made to survive a writer killed mid-append.

Owns: reading the journal's records (a torn LAST line, the tail of an append whose writer was
killed or is still writing, is skipped, as Optuna does; an undecodable line anywhere before it is
one UserError naming the file and its byte offset instead of a JSONDecodeError traceback),
appending under the journal's lock (locks.JournalLock) after first cutting a torn tail back to
the last complete record, so that the next record starts on a fresh line, and telling a file that
is no journal at all (a training TOML given to `tune status`) from a damaged one.

Why cut the torn tail rather than end it with a newline: a newline would turn the fragment into a
complete, undecodable line in the middle of the file, which Optuna's own reader (optuna-dashboard,
another Optuna process on the same journal) then refuses for ever; the fragment is bytes that no
reader ever accepted as a record, so dropping it loses nothing. It must never decide what the
records mean (Optuna's JournalStorage does).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.logs import get_logger

logger = get_logger(__name__)

CHUNK = 1 << 16  # bytes read at a time when looking back for the last complete record


def backend(journal: str | Path):
    """A JournalFileBackend on `journal` with our lock, tolerant reads and repairing appends."""
    from optuna.storages.journal import JournalFileBackend

    from hpctrain.tune import locks

    class TornTolerantBackend(JournalFileBackend):
        def read_logs(self, log_number_from: int) -> list[dict]:
            return read_records(self, log_number_from)

        def append_logs(self, logs: list[dict]) -> None:
            text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
            self._lock.acquire()
            try:
                cut_torn_tail(Path(self._file_path))
                with open(self._file_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                self._lock.release()

    return TornTolerantBackend(str(journal), lock_obj=locks.JournalLock(journal))


def damaged(path, offset: int, number: int, why: str) -> UserError:
    return UserError(f"{path}: damaged study journal at byte {offset} (record {number + 1}: {why}); "
                     f"keep a copy, then cut it there (truncate -s {offset} {path}) to go on "
                     f"with the records before it")


def _decode(line: bytes, path, offset: int, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (NUL bytes, binary garbage)
        raise damaged(path, offset, number, f"not a JSON record: {str(e)[:80]}") from None
    if not isinstance(record, dict) or "op_code" not in record:
        raise damaged(path, offset, number, "not an Optuna journal record")
    return record


def read_records(backend, log_number_from: int) -> list[dict]:
    """Optuna's read_logs (records from number `log_number_from` on; the byte offset of each record
    number read is cached in backend._log_number_offset), with damaged lines named."""
    path, offsets = backend._file_path, backend._log_number_offset
    number = log_number_from if log_number_from in offsets else 0
    start = offsets[number]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(start)
        data = f.read(max(0, size - start))  # what a writer appends meanwhile waits for next time
    records, pos = [], 0
    while (end := data.find(b"\n", pos)) >= 0:  # no newline after pos: a torn or growing last line
        if number >= log_number_from:
            records.append(_decode(data[pos:end + 1], path, start + pos, number))
        pos = end + 1
        number += 1
        offsets[number] = start + pos
    return records


def _last_newline_end(f, size: int) -> int:
    """The offset just after the file's last b'\\n' (0: none)."""
    end = size
    while end > 0:
        begin = max(0, end - CHUNK)
        f.seek(begin)
        at = f.read(end - begin).rfind(b"\n")
        if at >= 0:
            return begin + at + 1
        end = begin
    return 0


def cut_torn_tail(path: Path) -> int:
    """Under the journal's lock: drop bytes after the last complete record (a killed writer's torn
    append; no writer is running). The number of bytes dropped."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = _last_newline_end(f, size)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    logger.warning(f"[tune] {path}: dropped a torn last record ({size - keep} bytes at byte "
                   f"{keep}: its writer was killed mid-append)")
    return size - keep


def check_is_journal(path: Path) -> None:
    """One UserError for a file that is no journal at all (its first byte is not a JSON record's);
    a training TOML is told which journal to pass instead."""
    with open(path, "rb") as f:
        head = f.read(1)
    if head in (b"", b"{"):
        return
    from hpctrain import config

    try:
        raw = config.tomllib.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path}: not a study journal (byte 0 is not a JSON record): pass the "
                        f"[tune] journal file of a search (default <run.dir>/study.journal)") from None
    tune, run = raw.get("tune", {}), raw.get("run", {})
    journal = tune.get("journal") or str(Path(run.get("dir", ".")) / "study.journal")
    raise UserError(f"{path}: a training config, not a study journal: pass its [tune] journal "
                    f"instead (python -m hpctrain tune status {journal})")
