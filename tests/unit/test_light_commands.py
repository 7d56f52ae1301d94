"""Commands that only read files do not import torch (`hpctrain plot`; `ckpt list|verify` are in
test_checkpoint_cli_export.py): torch costs ~1.7-2.5 s of CPU per call, more than their own work."""
from __future__ import annotations

import json
import sys

from tests.conftest import run_cmd


def test_plot_draws_a_run_without_importing_torch(tmp_path):
    steps = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 100.0 + s, "mfu": 0.01}
             for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    r = run_cmd([sys.executable, "-X", "importtime", "-m", "hpctrain", "plot", tmp_path],
                timeout=120, check=True)
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines()}
    assert "matplotlib" in imported and "hpctrain.metrics.plot" in imported
    assert "torch" not in imported
    assert str(tmp_path / "metrics.png") in r.stdout.split()
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
