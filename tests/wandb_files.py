"""W&B in tests, never the network: the environment of an offline run, and what offline runs wrote,
read back (hpctrain/metrics/wandb_history.py reads W&B's transaction log: the tests compare its
rows with metrics.jsonl's numbers, so a misread fails them).

An offline run is a directory `offline-run-<YYYYmmdd_HHMMSS>-<id>/` holding `run-<id>.wandb`, the
run's records (what `wandb sync` uploads)."""
from __future__ import annotations

import os
from pathlib import Path

from hpctrain.metrics.wandb_history import history

# The environment of a test run with W&B: offline, no git / code / system probes (never the network)
OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
               "WANDB_X_DISABLE_STATS": "true", "WANDB_X_DISABLE_MACHINE_INFO": "true",
               "WANDB_SILENT": "true"}


def offline_runs(root: Path) -> list[tuple[str, list[dict]]]:
    """(run id, history rows) of every offline run under `root` (a WANDB_DIR or a run dir's
    `wandb/`), oldest first."""
    dirs = sorted(p for p in Path(root).rglob("offline-run-*") if p.is_dir() and not p.is_symlink())
    out = []
    for d in dirs:
        (run_file,) = d.glob("run-*.wandb")
        out.append((run_file.stem[len("run-"):], history(run_file)))
    return out


def offline_env(**extra) -> dict:
    """OFFLINE_ENV (+ `extra`, e.g. WANDB_DIR=...) for a training subprocess."""
    return {**OFFLINE_ENV, **{k: str(v) for k, v in extra.items()}}


def set_offline(monkeypatch) -> None:
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    assert os.environ["WANDB_MODE"] == "offline"
