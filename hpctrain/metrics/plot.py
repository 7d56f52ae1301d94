"""`python -m hpctrain plot RUN_DIR`: a PNG of loss, validation loss, tokens/s and MFU over steps.

Owns: reading `metrics.jsonl` and drawing it. matplotlib is an optional dependency (extra `plot`);
without it the command says how to install it. It must never write anywhere but the output path.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.metrics.jsonl import read


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.exists():
        raise UserError(f"{path}: no metrics (is this a run directory?)")
    recs = read(path)
    steps = [r for r in recs if "loss" in r]
    if not steps:
        raise UserError(f"{path}: no training steps recorded yet")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'hpctrain[plot]' (or pip install matplotlib)") from None

    x = [r["step"] for r in steps]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0][0]
    ax.plot(x, [r["loss"] for r in steps], lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax.legend()
    ax = axes[0][1]
    ax.plot(x, [r["lr"] for r in steps], lw=1)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax = axes[1][0]
    ax.plot(x, [r["tokens_per_s"] for r in steps], lw=1)
    ax.set(xlabel="step", ylabel="tokens / s (all ranks)", title="throughput")
    ax = axes[1][1]
    ax.plot(x, [100 * r.get("mfu", float("nan")) for r in steps], lw=1)
    ax.set(xlabel="step", ylabel="MFU (%)", title="model FLOP utilization")
    fig.suptitle(str(run_dir))
    out = Path(out) if out else (run_dir if run_dir.is_dir() else run_dir.parent) / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpctrain plot",
                                 description="Plot loss, val loss, lr, tokens/s and MFU of a run to a PNG.")
    ap.add_argument("run_dir", help="run directory (holding metrics.jsonl) or a metrics.jsonl file")
    ap.add_argument("--output", "-o", help="PNG path (default: RUN_DIR/metrics.png)")
    args = ap.parse_args(argv)
    print(plot_run(args.run_dir, args.output))
    return 0
