"""`metrics.jsonl`: one JSON object per optimizer step, written by rank 0 only.

On resume from step S, records with step > S (written after the checkpoint by a run that was then
stopped or killed) are dropped first, so the log reads as one uninterrupted run. The rewrite is
atomic (temp file + rename). Each record is flushed as it is written so `tail -f` works.

The same records also go to TensorBoard event files in `tensorboard/` next to the log, when the
`tensorboard` package is installed and `HPCTRAIN_TENSORBOARD` is not 0 (see `tensorboard.py`). A
failure there is reported once and turns TensorBoard off; it never stops training.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpctrain.metrics import tensorboard


class MetricsLog:
    def __init__(self, path: str | Path, enabled: bool, resume_step: int = 0):
        self.path = Path(path)
        self.enabled = enabled
        self._f = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = tensorboard.open_writer(self.path.parent / "tensorboard", resume_step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line, rec in _records(self.path) if rec.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()
        if self._tb is not None:
            try:
                self._tb.write(record)
            except Exception as e:  # a view of the log: never worth stopping training for
                print(f"warning: TensorBoard logging off after an error: {e}", file=sys.stderr)
                self._close_tb()

    def _close_tb(self) -> None:
        tb, self._tb = self._tb, None
        if tb is not None:
            try:
                tb.close()
            except Exception:
                pass

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._close_tb()


def _records(path: Path):
    """(line, record) of every intact line: a line torn by a kill -9 mid-write, or bytes that are
    not UTF-8 (a damaged block on a parallel file system), is skipped, never fatal."""
    for raw in Path(path).read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            yield line, rec


def read(path: str | Path) -> list[dict]:
    return [rec for _, rec in _records(Path(path))]
