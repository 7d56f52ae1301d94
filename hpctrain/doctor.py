"""`hpctrain doctor RUN`: what each rank was doing when a run hung or lost a rank.

Owns reading `<RUN>/forensics/rank_<r>.json` (written by the watchdog through
hpctrain/distributed/flight_recorder.py on a verdict or a stall) and the short summary: per rank
(ranks that agree grouped) where it was — its step and the collective it was inside (operation,
group, sequence number) or, in none, its innermost hpctrain frame — which ranks wrote no file or
were named lost, and what to check: the rank(s) that never entered the collective the others wait
in, with that rank's stack. No files: one line, exit 1. A damaged file (not JSON, truncated,
nested too deep, over MAX_FILE_BYTES, or JSON of another shape) is named with what is wrong and the
other ranks are still reported; every file damaged: one `error:` line per file, exit 1. It must
never modify the run directory, nor read a file whole before its size is known to be sane.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from hpctrain.distributed.flight_recorder import FORENSICS_DIR

STACK_LINES = 12


# A real file is tens to hundreds of KiB (every thread's stack, the last 64 collectives): a file
# larger than this is not one hpctrain wrote, and is not read (json.loads would hold it 5-10 x).
MAX_FILE_BYTES = 16 << 20
MAX_WORLD = 1 << 20  # a world larger than this is a damaged number (the report lists the ranks)
# field -> (kind, may it be null, must it be present); kinds: see _KINDS
RECORD_FIELDS = {
    "rank": ("int", False, True), "world": ("int", False, True), "step": ("step", False, True),
    "kind": ("str", False, False), "verdict": ("str", False, False), "lost": ("int", True, False),
    "pid": ("int", True, False), "host": ("str", True, False),
    "innermost_frame": ("str", True, False), "open": ("entry", True, False),
    "collectives": ("entries", False, False), "stacks": ("stacks", False, False)}
ENTRY_FIELDS = {"op": ("str", False, True), "group": ("str", False, True),
                "seq": ("int", False, True), "left": ("bool", False, True),
                "duration_s": ("number", False, True), "step": ("int", False, False),
                "open": ("bool", False, False), "entered_s_ago": ("number", False, False)}


class DamagedFile(ValueError):
    """A forensics file that cannot be used; str(): what is wrong with it."""


def load(run: Path) -> dict[int, dict]:
    """rank -> its forensics record (damaged files are left out; `load_all` names them)."""
    return load_all(run)[0]


def load_all(run: Path) -> tuple[dict[int, dict], list[tuple[int | None, Path, str]]]:
    """(rank -> its forensics record, [(the rank its name gives or None, path, what is wrong)] of
    the files that cannot be used). Reads at most MAX_FILE_BYTES of each; never writes."""
    recs, damaged = {}, []
    for path in sorted((run / FORENSICS_DIR).glob("rank_*.json")):
        named = path.name[len("rank_"):-len(".json")]
        named_rank = int(named) if named.isdigit() else None
        try:
            rec = read_record(path)
            if named_rank != rec["rank"]:
                raise DamagedFile(f"holds rank {rec['rank']}, but its name is not "
                                  f"rank_{rec['rank']}.json")
            recs[rec["rank"]] = rec
        except DamagedFile as e:
            damaged.append((named_rank, path, str(e)))
    return recs, damaged


def read_record(path: Path) -> dict:
    """One forensics record, its shape checked; DamagedFile saying what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
    except OSError as e:
        raise DamagedFile(f"unreadable ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedFile("not a regular file")
        try:
            raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise DamagedFile(f"unreadable ({e.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise DamagedFile(f"larger than {MAX_FILE_BYTES >> 20} MiB (hpctrain writes well "
                          f"under 1 MiB): not read")
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DamagedFile(f"not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise DamagedFile("JSON nested too deeply to parse (a forensics record is 4 levels "
                          "deep)") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer of over 4300 digits
        raise DamagedFile(f"not valid JSON ({e}): truncated or overwritten") from None
    return check_record(rec)


def check_record(rec) -> dict:
    """`rec` if it has the shape `flight_recorder.forensics` writes; else DamagedFile."""
    if not isinstance(rec, dict):
        raise DamagedFile(f"a JSON {_json_kind(rec)}, not an object")
    _check_fields(rec, RECORD_FIELDS, "the record")
    if rec["rank"] < 0 or not 1 <= rec["world"] <= MAX_WORLD or rec["rank"] >= rec["world"]:
        raise DamagedFile(f"rank {rec['rank']} of world {rec['world']} is impossible")
    return rec


def _check_fields(obj, fields: dict, what: str) -> None:
    if not isinstance(obj, dict):
        raise DamagedFile(f"{what} is a JSON {_json_kind(obj)}, not an object")
    for name, (kind, nullable, required) in fields.items():
        if name not in obj:
            if required:
                raise DamagedFile(f"{what} has no field {name!r}")
            continue
        value = obj[name]
        if value is None and nullable:
            continue
        if kind == "entry":
            _check_fields(value, ENTRY_FIELDS, f"field {name!r}")
        elif kind == "entries":
            _check_list(value, name, lambda e, i: _check_fields(e, ENTRY_FIELDS, f"{name}[{i}]"))
        elif kind == "stacks":
            _check_stacks(value)
        elif not _KINDS[kind](value):
            raise DamagedFile(f"field {name!r} is {_shown(value)}, not {_KIND_NAMES[kind]}")


def _check_list(value, name: str, check_item) -> None:
    if not isinstance(value, list):
        raise DamagedFile(f"field {name!r} is {_shown(value)}, not a list")
    for i, item in enumerate(value):
        check_item(item, i)


def _check_stacks(stacks) -> None:
    """thread name -> list of formatted stack lines."""
    if not isinstance(stacks, dict):
        raise DamagedFile(f"field 'stacks' is {_shown(stacks)}, not an object")
    for thread, lines in stacks.items():
        if not isinstance(lines, list) or not all(isinstance(ln, str) for ln in lines):
            raise DamagedFile(f"field 'stacks' thread {thread[:60]!r} is not a list of text lines")


_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          # a beacon's verdict record (beacon.py) does not know the step: "?"
          "step": lambda v: v == "?" or (isinstance(v, int) and not isinstance(v, bool)),
          "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
_KIND_NAMES = {"int": "an integer", "step": 'an integer (or "?")', "str": "a string", "bool": "true/false", "number": "a number"}


def _json_kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    """A field's value for a message: short, with its JSON kind."""
    text = json.dumps(value)[:40] if not isinstance(value, (dict, list)) else ""
    return f"{text} (a JSON {_json_kind(value)})" if text else f"a JSON {_json_kind(value)}"


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


def summary(recs: dict[int, dict], damaged=()) -> list[str]:
    """The report's lines (see the module docstring); `damaged`: `load_all`'s unusable files."""
    world = max(int(r.get("world", 0)) for r in recs.values())
    lost = sorted({r["lost"] for r in recs.values() if r.get("lost") is not None})
    verdicts = sorted({r.get("verdict") or "?" for r in recs.values() if r.get("kind") == "verdict"})
    lines = [f"forensics of {len(recs)} of {world} ranks"
             + (f"; verdict: {verdicts[0]}" if verdicts else "; no verdict (a stall)")]
    groups: dict[str, list[int]] = {}
    for r in sorted(recs):
        groups.setdefault(_where(recs[r]), []).append(r)
    lines += [f"{_ranks(rs)}: {where}" for where, rs in groups.items()]
    lines += [(f"rank {r}: " if r is not None else "") + f"damaged forensics file {path}: {what}"
              for r, path, what in damaged]
    unreadable = {r for r, _, _ in damaged if r is not None and r not in recs}
    missing = [r for r in range(world) if r not in recs and r not in unreadable]
    if missing:
        named = [r for r in missing if r in lost]
        lines.append(f"{_ranks(missing)}: no forensics file"
                     + (f" ({_ranks(named)} named lost by the watchdog)" if named else
                        " (killed, stopped, or its node is gone)"))
    lines += _advice(recs, sorted(set(missing) | unreadable), lost, unreadable)
    return lines


def _advice(recs: dict[int, dict], missing: list[int], lost: list[int],
            unreadable=frozenset()) -> list[str]:
    """`missing`: the ranks without a usable file (`unreadable`: those whose file is damaged)."""
    key = _waited_in(recs)
    if key is None:
        return [f"check: {_ranks(lost or missing)} (named lost / no usable file)"] if lost or missing else []
    op, group, seq = key
    waiting = [r for r in sorted(recs) if _key(recs[r].get("open")) == key]
    absent = sorted(set(missing) | {r for r in recs if not _entered(recs[r], key)})
    if not absent:
        return [f"check: every rank with a file is inside {op} {group} seq {seq}: a rank inside it "
                f"without a file, or the network between them"]
    are = "are" if len(waiting) > 1 else "is"
    if set(absent) <= set(missing):  # no file: whether it entered is unknown
        no_file = "no usable forensics file" if set(absent) & set(unreadable) else "no forensics file"
        return [f"check: {_ranks(absent)} ({no_file}) did not complete {op} {group} seq "
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
    recs, damaged = load_all(run)
    if not recs:
        for _, path, what in damaged:  # every file damaged: each named, no report
            print(f"error: {path}: {what} (no intact forensics file to report from)",
                  file=sys.stderr)
        if not damaged:
            print(f"error: no forensics files in {run / FORENSICS_DIR} (written only when a run "
                  f"hangs or loses a rank)", file=sys.stderr)
        return 1
    print("\n".join(summary(recs, damaged)))
    return 0
