"""Weights & Biases logging of `metrics.jsonl`'s records (rank 0 only), with `metrics.wandb = true`.

Owns: the W&B run of a run directory (its id, kept in `<run.dir>/wandb_run.json`, so that a requeue
or a resume in a later job continues the same W&B run), and turning a metrics record into one
`run.log(scalars, step=record["step"])`, with the TensorBoard tags (`train/loss`, `val/loss`,
`perf/tokens_per_s`, ...: tensorboard.scalars). `metrics.jsonl` stays the record of truth; this is a
view of it, like TensorBoard: a failure while logging is reported once and turns W&B off, it never
stops training.

Optional: `wandb` is the extra `pip install 'hpctrain[wandb]'`; `check_installed` refuses
`metrics.wandb = true` without it at start, before MPI (hpctrain/__main__.py). Imported lazily.

Network: W&B's own `WANDB_MODE` is honoured. On compute nodes without network set
`WANDB_MODE=offline`: the run is written to `<run.dir>/wandb/offline-run-*` (or under `$WANDB_DIR`)
and `wandb sync <run.dir>/wandb/offline-run-*` uploads it later from a login node.

Resume: W&B cannot take back a logged step. The loop reopens the log at the checkpoint's step S,
keeping metrics.jsonl's records up to S. The W&B run continues, and first learns the last step it
holds, H: online the server's; offline the last row of its earlier `offline-run-*` files
(wandb_history.py; a killed job's W&B service dies with the rows of its last seconds, which only
reach the file every 15 s or at the end). The kept records after H are replayed from the file, and
the re-run steps W&B holds (up to H) are not logged again (the re-run is bit-exact): W&B ends with
every step once, metrics.jsonl's numbers. Without its earlier files (synced and cleaned, moved) H
is what metrics.jsonl held before. A bigger cut (a start over, a resume from an older checkpoint:
the cases where metrics.jsonl keeps its old file aside) starts a new W&B run holding the kept log,
so no W&B run mixes two histories; the old W&B run stays as the record of what was cut. Turning
W&B on at a resume gives the new W&B run the whole log so far.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import string
from pathlib import Path

from hpctrain import logs
from hpctrain.distributed.run_lock import assert_held
from hpctrain.errors import ConfigError
from hpctrain.metrics.tensorboard import scalars

log = logs.get_logger(__name__)

ID_FILE = "wandb_run.json"


def check_installed(cfg) -> None:
    """One error line (naming the key and the pip command) for metrics.wandb = true without wandb."""
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("config key 'metrics.wandb': true, but the wandb package is not installed: "
                          "pip install 'hpctrain[wandb]' (or set metrics.wandb = false)")


def slurm_group() -> str | None:
    """The Slurm job array's id, else the Slurm job's id; None outside Slurm."""
    return os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID") or None


def new_id() -> str:
    """A W&B run id: 8 characters of [a-z0-9], as W&B makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbWriter:
    """One W&B run; a record at or before `held` (a step the run holds already) is not logged."""

    def __init__(self, run, held: int | None):
        self.run = run
        self.held = held

    def write(self, record: dict) -> None:
        step = record.get("step")
        if step is None or (self.held is not None and step <= self.held):
            return
        values = dict(scalars(record))
        if values:
            self.run.log(values, step=int(step))
        self.held = step - 1  # a later record of the same step (validation) goes to the same row

    def replay(self, records: list[dict]) -> int:
        """Log the records (metrics.jsonl's, in order) of steps the run does not hold; how many.
        The run then holds the last of them (a live record of that step is not logged again)."""
        held, count = self.held, 0
        for rec in records:
            step = rec.get("step")
            if isinstance(step, int) and (held is None or step > held):
                self.write(rec)
                count += 1
        if count:
            self.held = self.held + 1
        return count

    def close(self) -> None:
        """Finish the run and stop W&B's service process, which writes the last records of an
        offline run to disk only as it stops (the trainer then ends with os._exit)."""
        import wandb

        self.run.finish()
        wandb.teardown()


def _read_identity(path: Path) -> dict | None:
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) and stored.get("id") else None


def _run_identity(run_dir: Path, cfg, fresh: bool, root: str) -> tuple[dict, bool]:
    """({id, group, dirs} of the W&B run to log to, whether it continues the stored one: not when
    `fresh`, a start at step 0 or after a cut). `dirs`: every WANDB_DIR the run's files went to."""
    path = run_dir / ID_FILE
    stored = _read_identity(path)
    continued = stored is not None and not fresh
    if continued:
        dirs = stored.get("dirs", [])
        identity = {**stored, "dirs": dirs if root in dirs else [*dirs, root]}
    else:
        group = slurm_group() if cfg.metrics.wandb_group == "auto" else (cfg.metrics.wandb_group or None)
        identity = {"id": new_id(), "group": group, "dirs": [root]}
        if stored is not None:
            log.info(f"metrics: W&B run {stored['id']} keeps what it logged; this start (a start over "
                     f"or a cut of the log) logs to a new W&B run {identity['id']}")
    if identity != stored:
        assert_held()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(identity) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return identity, continued


def held_through(run, identity: dict, jsonl_last: int | None) -> int | None:
    """The last step the continued W&B run holds: online, the server's; offline, the last row of
    its earlier offline files (a killed job's W&B service dies with the buffered rows of its last
    seconds); without those files (synced and cleaned, moved) what metrics.jsonl last held."""
    if not run.offline:
        step = run.step  # the step of the next log(): one past the server's last
        return step - 1 if step > 0 else None
    from hpctrain.metrics import wandb_history

    own = Path(run.settings.sync_dir)
    files = [f for d in identity["dirs"] for f in wandb_history.run_files(d, identity["id"]) if f.parent != own]
    if not files:
        return jsonl_last
    try:
        return wandb_history.last_step(files)
    except (OSError, ValueError) as e:
        log.warning(f"warning: W&B: cannot read {files[-1]} ({e}): taking the run to hold what "
                    f"metrics.jsonl held (step {jsonl_last})")
        return jsonl_last


def open_writer(cfg, start) -> WandbWriter | None:
    """The W&B run of metrics log `start` (a MetricsLog as opened: its path, resume_step, the
    records it kept, its last_step before, cut: its old file kept aside), brought up to the kept
    records (replayed where W&B lacks them); None with metrics.wandb = false, or when W&B cannot
    start (one warning)."""
    if not cfg.metrics.wandb:
        return None
    try:
        import wandb
    except ImportError:
        check_installed(cfg)  # the error line of the start-up check (a PBT member skips that one)
        raise
    run_dir, m = start.path.parent, cfg.metrics
    root = os.environ.get("WANDB_DIR") or str(run_dir)
    identity, continued = _run_identity(run_dir, cfg, start.cut or start.resume_step == 0, root)
    try:
        run = wandb.init(project=m.wandb_project, entity=m.wandb_entity or None,
                         name=m.wandb_run_name or run_dir.name, group=identity.get("group"),
                         id=identity["id"], resume="allow", config=cfg.to_dict(), allow_val_change=True,
                         job_type="train",
                         dir=root, settings=wandb.Settings(console="off", quiet=True))
    except Exception as e:  # no network without WANDB_MODE=offline, a bad entity, ...
        log.warning(f"warning: W&B logging off: {e} (no network on this node? set WANDB_MODE=offline "
                    f"and run `wandb sync` later)")
        return None
    writer = WandbWriter(run, held_through(run, identity, start.last_step) if continued else None)
    held, replayed = writer.held, writer.replay(start.kept)
    where = f"upload with `wandb sync {run.settings.sync_dir}`" if run.offline else run.url
    log.info(f"metrics: W&B run {identity['id']} ({'continued' if continued else 'new'}, {run.settings.mode}"
             f"{f', holds step {held}' if held is not None else ''}"
             f"{f', {replayed} record(s) of metrics.jsonl replayed' if replayed else ''}): {where}")
    return writer
