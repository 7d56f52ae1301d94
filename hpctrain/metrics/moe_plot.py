"""`hpctrain plot`'s expert-load heat map of a mixture-of-experts run: per MoE layer, the tokens
each expert received at each step (the `moe.<layer>.load` lists of metrics.jsonl, written by
hpctrain/train/moe_monitor.py) divided by the layer's mean load, steps across, experts down.
1.0 (white) is a balanced expert; red above the mean, blue below.

Owns: turning the records into one matrix per layer (`load_matrices`) and drawing them into one
PNG (`expert_load.png` beside metrics.png). A dense run has no such keys and gets no heat map.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_LOAD_KEY = re.compile(r"^moe\.(.+)\.load$")


def load_matrices(recs: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{layer: (steps [S], load / mean [S, E])} over the records that carry the layer's loads, layers
    in model order."""
    rows: dict[str, tuple[list, list]] = {}
    for rec in recs:
        for key, load in rec.items():
            match = _LOAD_KEY.match(key)
            if not match or not load:
                continue
            steps, loads = rows.setdefault(match.group(1), ([], []))
            mean = sum(load) / len(load)
            steps.append(rec["step"])
            loads.append([n / mean if mean else 0.0 for n in load])
    order = sorted(rows, key=lambda name: (not name.isdigit(), int(name) if name.isdigit() else 0, name))
    return {name: (np.array(rows[name][0]), np.array(rows[name][1], dtype=np.float64)) for name in order}


def plot_expert_load(recs: list[dict], out: Path, title: str) -> Path | None:
    """The heat map PNG at `out`, or None when the records hold no MoE loads (a dense run)."""
    layers = load_matrices(recs)
    if not layers:
        return None
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(len(layers), 1, figsize=(11, 1.2 + 2.2 * len(layers)),
                             constrained_layout=True, squeeze=False)
    top = max(2.0, max(float(m.max()) for _, m in layers.values()))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    for ax, (name, (steps, matrix)) in zip(axes[:, 0], layers.items()):
        image = ax.imshow(matrix.T, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, matrix.shape[1] - 0.5, -0.5))
        ax.set(xlabel="step", ylabel="expert", title=f"MoE layer {name}: tokens per expert / mean")
        fig.colorbar(image, ax=ax, label="load / mean")
    fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
