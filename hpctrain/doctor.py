"""`hpctrain doctor RUN`: what each rank was doing when a run hung or lost a rank.

Owns reading `<RUN>/forensics/rank_<r>.json` (written by the watchdog through
hpctrain/distributed/flight_recorder.py on a verdict or a stall) and the short summary: per rank
(ranks that agree grouped) where it was — its step and the collective it was inside (operation,
group, sequence number) or, in none, its innermost hpctrain frame — which ranks wrote no file or
were named lost, and what to check: the rank(s) that never entered the collective the others wait
in, with that rank's stack. No files: one line, exit 1. It must never modify the run directory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpctrain.distributed.flight_recorder import FORENSICS_DIR

STACK_LINES = 12


def load(run: Path) -> dict[int, dict]:
    """rank -> its forensics record (unreadable files are skipped)."""
    out = {}
    for path in sorted((run / FORENSICS_DIR).glob("rank_*.json")):
        try:
            rec = json.loads(path.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _key(c: dict | None) -> tuple | None:
    return None if c is None else (c["op"], c["group"], c["seq"])


def _where(rec: dict) -> str:
    c = rec.get("open")
    if c is not None:
        return (f"step {rec['step']}, inside {c['op']} {c['group']} seq {c['seq']} "
                f"(for {c['duration_s']:.1f} s)")
    last = next((e for e in reversed(rec.get("collectives", [])) if e.get("left")), None)
    after = f"; last left {last['op']} {last['group']} seq {last['seq']}" if last else ""
    return f"step {rec['step']}, in no collective{after}; at {rec.get('innermost_frame') or '?'}"


def _entered(rec: dict, key: tuple) -> bool:
    return any(_key(e) == key for e in rec.get("collectives", []))


def _waited_in(recs: dict[int, dict]) -> tuple | None:
    """The collective most ranks are open in (ties: the lowest rank's)."""
    counts: dict[tuple, int] = {}
    for r in sorted(recs):
        k = _key(recs[r].get("open"))
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return max(counts, key=counts.get) if counts else None


def summary(recs: dict[int, dict]) -> list[str]:
    """The report's lines (see the module docstring)."""
    world = max(int(r.get("world", 0)) for r in recs.values())
    lost = sorted({r["lost"] for r in recs.values() if r.get("lost") is not None})
    verdicts = sorted({r["verdict"] for r in recs.values() if r.get("kind") == "verdict"})
    lines = [f"forensics of {len(recs)} of {world} ranks"
             + (f"; verdict: {verdicts[0]}" if verdicts else "; no verdict (a stall)")]
    groups: dict[str, list[int]] = {}
    for r in sorted(recs):
        groups.setdefault(_where(recs[r]), []).append(r)
    lines += [f"{_ranks(rs)}: {where}" for where, rs in groups.items()]
    missing = [r for r in range(world) if r not in recs]
    if missing:
        named = [r for r in missing if r in lost]
        lines.append(f"{_ranks(missing)}: no forensics file"
                     + (f" ({_ranks(named)} named lost by the watchdog)" if named else
                        " (killed, stopped, or its node is gone)"))
    lines += _advice(recs, missing, lost)
    return lines


def _advice(recs: dict[int, dict], missing: list[int], lost: list[int]) -> list[str]:
    key = _waited_in(recs)
    if key is None:
        return [f"check: {_ranks(lost or missing)} (named lost / no file)"] if lost or missing else []
    op, group, seq = key
    waiting = [r for r in sorted(recs) if _key(recs[r].get("open")) == key]
    absent = sorted(set(missing) | {r for r in recs if not _entered(recs[r], key)})
    if not absent:
        return [f"check: every rank with a file is inside {op} {group} seq {seq}: a rank inside it "
                f"without a file, or the network between them"]
    are = "are" if len(waiting) > 1 else "is"
    if set(absent) <= set(missing):  # no file: whether it entered is unknown
        return [f"check: {_ranks(absent)} (no forensics file) did not complete {op} {group} seq "
                f"{seq} that {_ranks(waiting)} {are} waiting in: look at its process and host "
                f"(stopped, swapping, killed, or the node down)"]
    lines = [f"check: {_ranks(absent)} never entered {op} {group} seq {seq} that "
             f"{_ranks(waiting)} {are} waiting in: look at {_ranks(absent)}'s stack below"]
    for r in absent:
        if r in recs:
            lines.append(f"rank {r} (pid {recs[r].get('pid')} on {recs[r].get('host')}), main thread:")
            lines += ["  " + ln.rstrip() for ln in _main_stack(recs[r])[-STACK_LINES:]]
    return lines


def _main_stack(rec: dict) -> list[str]:
    stacks = rec.get("stacks", {})
    name = next((n for n in stacks if n.startswith("MainThread")), None)
    text = "".join(stacks.get(name, [])) if name else ""
    return text.splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hpctrain doctor",
        description="Summarize a hang or a lost rank from RUN/forensics/rank_<r>.json (written by "
                    "every surviving rank on a watchdog verdict or a stall longer than "
                    "dist.stall_timeout_s): where each rank was (step, the collective it was "
                    "inside with its group and sequence number), which ranks are missing, and "
                    "which rank never entered the collective the others wait in.")
    parser.add_argument("run", help="the run directory (run.dir)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    recs = load(run)
    if not recs:
        print(f"error: no forensics files in {run / FORENSICS_DIR} (written only when a run hangs "
              f"or loses a rank)", file=sys.stderr)
        return 1
    print("\n".join(summary(recs)))
    return 0
