"""`python -m hpctrain plot RUN_DIR`: a PNG of loss, validation loss, tokens/s and MFU over steps,
and for a mixture-of-experts run a heat map of each MoE layer's expert load over steps beside it
(expert_load.png: hpctrain/metrics/moe_plot.py).

Owns: reading `metrics.jsonl` and drawing it. matplotlib is an optional dependency (extra `plot`);
without it the command says how to install it. It must never write anywhere but the output path.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.metrics.jsonl import read
from hpctrain.metrics.moe_plot import plot_expert_load


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """The PNGs written: metrics.png (or `out`), and expert_load.png beside it for an MoE run."""
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
    heat_map = plot_expert_load(recs, out.with_name("expert_load.png"), str(run_dir))
    return [out] + ([heat_map] if heat_map else [])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpctrain plot",
                                 description="Plot loss, val loss, lr, tokens/s and MFU of a run to a PNG "
                                             "(and an MoE run's expert load to expert_load.png).")
    ap.add_argument("run_dir", help="run directory (holding metrics.jsonl) or a metrics.jsonl file")
    ap.add_argument("--output", "-o", help="PNG path (default: RUN_DIR/metrics.png)")
    args = ap.parse_args(argv)
    for path in plot_run(args.run_dir, args.output):
        print(path)
    return 0
