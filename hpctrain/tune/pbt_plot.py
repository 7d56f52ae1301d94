"""`python -m hpctrain tune pbt-plot RUN_DIR`: a PNG of a population: each member's training and
validation loss (member_<i>/metrics.jsonl) and each tuned value over the steps (lineage.jsonl), with
the exploits marked (a member that copied another jumps to its loss curve).

Owns: reading those files and drawing them. matplotlib is optional (extra `plot`), as for
`hpctrain plot`. It must never write anywhere but the output path.
"""
from __future__ import annotations

import math
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.metrics.jsonl import read
from hpctrain.tune.pbt import LINEAGE, read_lineage


def value_schedules(lineage: list[dict]) -> dict[str, list[list[tuple[int, float]]]]:
    """{key: [[(step, value), ...] per member]}: the values each member trained with from each
    step on (the start, then every round)."""
    out: dict = {}
    for rec in lineage:
        if rec["event"] not in ("start", "round"):
            continue
        for member, values in enumerate(rec["values"]):
            for key, value in values.items():
                per_member = out.setdefault(key, [])
                while len(per_member) <= member:
                    per_member.append([])
                per_member[member].append((rec["step"], value))
    return out


def _member_metrics(run_dir: Path, members: int) -> list[list[dict]]:
    out = []
    for m in range(members):
        path = run_dir / f"member_{m}" / "metrics.jsonl"
        out.append(read(path) if path.exists() else [])
    return out


def plot_population(run_dir, out=None) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / LINEAGE).exists():
        raise UserError(f"{run_dir / LINEAGE}: no lineage (is this a `tune pbt` run.dir?)")
    lineage = read_lineage(run_dir)
    schedules = value_schedules(lineage)
    members = len(lineage[0]["values"])
    metrics = _member_metrics(run_dir, members)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'hpctrain[plot]' (or pip install "
                        "matplotlib)") from None
    rows = math.ceil((2 + len(schedules)) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), constrained_layout=True, squeeze=False)
    panels = [ax for row in axes for ax in row]
    colors = [f"C{m % 10}" for m in range(members)]
    for m, recs in enumerate(metrics):
        panels[0].plot([r["step"] for r in recs if "loss" in r], [r["loss"] for r in recs if "loss" in r],
                       lw=0.8, color=colors[m], label=f"member {m}")
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        if val:
            panels[1].plot(*zip(*val), "o-", ms=3, color=colors[m], label=f"member {m}")
    for rec in lineage:
        if rec["event"] == "round":  # the rounds' validation losses
            for m, loss in enumerate(rec["losses"]):
                panels[1].plot(rec["step"], loss, "x", ms=4, color=colors[m])
        if rec["event"] == "exploit":
            panels[1].plot([rec["step"]] * 2, [rec["loss"], rec["donor_loss"]], ":", color=colors[rec["member"]])
    panels[0].set(xlabel="step", ylabel="loss", title="training loss")
    panels[1].set(xlabel="step", ylabel="val loss", title="validation loss (x: rounds, dotted: exploit)")
    panels[0].legend(fontsize=8)
    last = max((r["step"] for recs in metrics for r in recs), default=0)
    for ax, (key, per_member) in zip(panels[2:], schedules.items()):
        for m, points in enumerate(per_member):
            if points[-1][0] < last:  # the last values held to the end of training
                points = [*points, (last, points[-1][1])]
            ax.step(*zip(*points), where="post", color=colors[m], label=f"member {m}")
        log_scale = all(v > 0 for pts in per_member for _, v in pts if isinstance(v, (int, float)))
        ax.set(xlabel="step", ylabel=key, title=key, yscale="log" if key.endswith("lr") and log_scale else "linear")
    for ax in panels[2 + len(schedules):]:
        ax.axis("off")
    fig.suptitle(f"PBT {run_dir}")
    out = Path(out) if out else run_dir / "pbt.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
