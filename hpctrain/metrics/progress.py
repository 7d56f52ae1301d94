"""Formatting for the one-line progress log of rank 0."""
from __future__ import annotations

import math


def format_eta(seconds: float) -> str:
    """Remaining time as `H:MM:SS` (`1d 02:03:04` from a day on); `?` when unknown (NaN, inf,
    negative)."""
    try:
        if not math.isfinite(seconds) or seconds < 0:
            return "?"
    except TypeError:
        return "?"
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    if days:
        return f"{days}d {h:02d}:{m:02d}:{s:02d}"
    return f"{h}:{m:02d}:{s:02d}"
