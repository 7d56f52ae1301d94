"""`metrics.jsonl`: one JSON object per optimizer step, written by rank 0 only (the run-dir lock's
holder: every write first checks that the lock is still this job's, see distributed/run_lock.py).

On resume from step S, records with step > S (written after the checkpoint by a run that was then
stopped or killed, or by a run whose checkpoints were moved away: S = 0) are dropped, so the log
reads as one uninterrupted run. A resume that re-runs at most `rerun_window` steps (checkpoint.interval:
what a kill between two saves loses; the re-run writes them again, bit-exactly) just replaces them.
A bigger cut (a start over, a resume from an older checkpoint) loses nothing: the file as it was is
kept, hard-linked as `metrics.<N>.jsonl` (N = 1, 2, ...: the first free one; an earlier kept file is
never replaced), with the TensorBoard event files as they were in `tensorboard.<N>/`, and one line
names them. The
rewrite is atomic (temp file + rename). Each record is appended with one write() so `tail -f` works;
a record that cannot be written (full disk) is cut back off the file and stops training with one
line naming the file: metrics are the record of the run, and a full disk fails the next checkpoint
too, so the run stops at its last committed checkpoint and resumes from it once there is space.

The same records also go to TensorBoard event files in `tensorboard/` next to the log, when the
`tensorboard` package is installed and `HPCTRAIN_TENSORBOARD` is not 0 (see `tensorboard.py`), and,
with `metrics.wandb = true` (the run's config given), to Weights & Biases (`wandb_log.py`). A
failure in one of these views is reported once and turns it off; it never stops training.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpctrain import logs
from hpctrain.errors import UserError
from hpctrain.metrics import tensorboard, wandb_log
from hpctrain.distributed.run_lock import assert_held

log = logs.get_logger(__name__)


class MetricsLog:
    """`cfg`: the run's config, for the views its [metrics] section turns on (W&B); None for the
    per-rank logs of workers that step apart."""

    def __init__(self, path: str | Path, enabled: bool, resume_step: int = 0, rerun_window: int = 0,
                 cfg=None):
        self.path = Path(path)
        self.rerun_window = rerun_window
        self.enabled = enabled
        self._fd = None
        self._views = {}  # name: writer (write, close) of the views of the log
        # this start: the step it resumes from, the records kept (step <= it), the last step the log
        # held before and whether that log was kept aside (a cut): what W&B needs to catch up
        self.resume_step, self.kept, self.last_step, self.cut = resume_step, [], None, False
        if not enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._resume_at(resume_step)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise _cannot_write(self.path, e, "open") from e
        views = {"TensorBoard": tensorboard.open_writer(self.path.parent / "tensorboard", resume_step)}
        if cfg is not None:
            views["W&B"] = wandb_log.open_writer(cfg, self)
        self._views = {name: w for name, w in views.items() if w is not None}
        self.kept = []

    def _resume_at(self, step: int) -> None:
        """Drop the records after `step` (keeping the file as it was), and any torn last line."""
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        lines = raw.splitlines()
        records = list(_parse(lines))
        kept = [line for line, rec in records if rec.get("step", 0) <= step]
        dropped = len(records) - len(kept)
        last = max((rec.get("step", 0) for _, rec in records), default=0)
        keep_old = dropped and (step == 0 or last - step > self.rerun_window)
        self.last_step, self.cut = (last if records else None), bool(keep_old)
        self.kept = [rec for _, rec in records if rec.get("step", 0) <= step]
        if not dropped and len(kept) == len(lines) and (not raw or raw.endswith(b"\n")):
            return  # nothing to drop, nothing torn: append to it as it is
        assert_held()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(k + "\n" for k in kept))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _cannot_write(self.path, e, "rewrite") from e
        try:
            kept_as = keep_aside(self.path) if keep_old else None
            os.replace(tmp, self.path)
        except OSError as e:  # no hard links here, say: nothing is dropped then
            tmp.unlink(missing_ok=True)
            raise _cannot_write(self.path, e, "keep a copy of") from e
        if kept_as is not None:
            why = f"re-run from the checkpoint of step {step}" if step else "no checkpoint: a start over"
            log.warning(f"metrics: {self.path}: {dropped} record(s) after step {step} are dropped "
                        f"({why}); the log as it was is kept as {kept_as}")

    def write(self, record: dict) -> None:
        if self._fd is None:
            return
        assert_held()
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        good = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            _cut_back(self._fd, good)
            raise _cannot_write(self.path, e, f"append step {record.get('step')} to") from e
        for name, view in list(self._views.items()):
            try:
                view.write(record)
            except Exception as e:  # a view of the log: never worth stopping training for
                log.warning(f"warning: {name} logging off after an error: {e}")
                self._close_view(name)

    def _close_view(self, name: str) -> None:
        view = self._views.pop(name, None)
        if view is not None:
            try:
                view.close()
            except Exception:
                pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for name in list(self._views):
            self._close_view(name)


def _cannot_write(path: Path, e: OSError, what: str) -> UserError:
    return UserError(f"{path}: cannot {what} the metrics log ({e.strerror or e}); training stops "
                     f"here: free space (or fix the permissions) and rerun the same command to "
                     f"resume from the last checkpoint")


def _cut_back(fd: int, size: int) -> None:
    """Remove a partly written record, so the file ends with the last whole one."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass  # a torn last line is skipped on resume and by `plot`


def keep_aside(path: Path) -> Path:
    """Hard-link `path` (metrics.jsonl) as metrics.<N>.jsonl, N the first free number (never
    replacing an earlier one), and the TensorBoard event files next to it into tensorboard.<N>/."""
    n = 1
    while True:
        kept = path.with_name(f"{path.stem}.{n}{path.suffix}")
        try:
            os.link(path, kept)
            break
        except FileExistsError:
            n += 1
    events = path.parent / "tensorboard"
    if path.name == "metrics.jsonl" and events.is_dir():
        into = path.parent / f"tensorboard.{n}"
        into.mkdir(exist_ok=True)
        for f in sorted(events.iterdir()):
            if f.is_file() and not (into / f.name).exists():
                os.link(f, into / f.name)
    return kept


def _parse(lines):
    """(line, record) of every intact line: a line torn by a kill -9 mid-write, or bytes that are
    not UTF-8 (a damaged block on a parallel file system), is skipped, never fatal."""
    for raw in lines:
        try:
            line = raw.decode("utf-8")
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            yield line, rec


def _records(path: Path):
    return _parse(Path(path).read_bytes().splitlines())


def read(path: str | Path) -> list[dict]:
    return [rec for _, rec in _records(Path(path))]
