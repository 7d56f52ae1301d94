"""`hpctrain plan --sbatch FILE`: the job script of the recommended layout, to submit as it is.

Owns: reading the template (slurm/train.sbatch, or --sbatch-template: a site's copy with its
ENVIRONMENT block), rewriting its #SBATCH lines for the planned job (--nodes, --ntasks-per-node:
one rank per GPU, --gpus-per-node: never --gpus-per-task, which confines each rank to its own GPU
under cgroups and so blocks CUDA IPC / NVLink between ranks; --cpus-per-task, --time, the USR1
--signal lead kept from the template, --job-name, --partition / --account when given), replacing
the template's `CONFIG=${1:?...}` and `shift` lines by the config and the layout's `hpctrain
train` flags (arguments given to `sbatch FILE` follow them, so a later --section.key=value wins),
and writing the file: a temporary file renamed into place, mode 0755, never over an existing
file without --force. Everything else of the template (preemption, requeue, node-loss relaunch)
is kept byte for byte. It must never judge a layout (search.py does).
"""
from __future__ import annotations

import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpctrain.distributed.slurm import parse_duration

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "slurm" / "train.sbatch"
SBATCH = re.compile(r"^(#{1,2})SBATCH\s+--([A-Za-z-]+)(?:[= ](\S*))?")
COMMAND = re.compile(r"^CONFIG=\$\{1:\?[^\n]*\}\nshift\n", re.M)
# Active lines that would contradict the written ones: commented out (one rank per GPU comes
# from --ntasks-per-node x --gpus-per-node; --gpus-per-task would block CUDA IPC).
CONFLICTS = ("ntasks", "gpus-per-task", "gres", "gpus", "ntasks-per-gpu", "gpus-per-socket")


@dataclass(frozen=True)
class Script:
    """What the written script asks of Slurm and runs."""
    nodes: int
    ranks_per_node: int
    gpus_per_node: int          # 0: CPU nodes (the template's --gpus-per-node line stays commented)
    config: str                 # the path written into the script
    flags: str                  # the layout's `hpctrain train` overrides
    layout: str                 # the layout's name, for the comment on top
    cpus_per_task: int | None = None    # None: the template's
    time: str | None = None             # None: the template's
    partition: str | None = None
    account: str | None = None


def read_template(path: str | Path | None) -> str:
    path = Path(path or TEMPLATE)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--sbatch-template {path}: cannot read it ({e.strerror}); give "
                         f"slurm/train.sbatch of an hpctrain checkout or a copy of it") from None
    if not COMMAND.search(text) or not any(SBATCH.match(x) for x in text.splitlines()):
        raise ValueError(f"--sbatch-template {path}: no #SBATCH lines or no `CONFIG=${{1:?...}}` + "
                         f"`shift` lines to write the config into: expected slurm/train.sbatch or a copy")
    return text


def check_target(path: str, force: bool) -> Path:
    """The file to write, or one line: it exists (no --force) or its folder does not."""
    target = Path(path)
    if target.exists() and not force:
        raise ValueError(f"--sbatch {path}: the file exists; give --force to replace it, or another name")
    if target.is_dir():
        raise ValueError(f"--sbatch {path}: a directory; give a file name")
    if not target.parent.is_dir():
        raise ValueError(f"--sbatch {path}: no directory {target.parent}; create it first")
    return target


def config_path(config: str | None, preset: str | None, shipped: str | None) -> str:
    """The config the script trains: --config as given, else the preset's shipped one (relative to
    the current directory when it is inside it)."""
    if config:
        return config
    if not shipped:
        raise ValueError(f"--sbatch needs --config FILE, the training TOML the job runs"
                         f"{f' (--preset {preset} has no shipped config)' if preset else ''}")
    rel = os.path.relpath(ROOT / shipped)
    return str(ROOT / shipped) if rel.startswith("..") else rel


def template_value(text: str, key: str) -> str | None:
    """The value of the template's active `#SBATCH --key=value` line."""
    for line in text.splitlines():
        m = SBATCH.match(line)
        if m and m.group(1) == "#" and m.group(2) == key:
            return m.group(3)
    return None


def signal_lead(text: str) -> int | None:
    """Seconds before the time limit the template's --signal asks USR1 for (`B:USR1@300`)."""
    m = re.search(r"@(\d+)$", template_value(text, "signal") or "")
    return int(m.group(1)) if m else None


def check_time(s: Script, text: str) -> str:
    """The wall time written (--time or the template's), or one line naming --time."""
    time = s.time or template_value(text, "time") or ""
    seconds, lead = parse_duration(time), signal_lead(text) or 0
    if seconds is None:
        raise ValueError(f"--time {time!r}: expected Slurm's [days-]hours:minutes:seconds "
                         f"(04:00:00, 2-00:00:00)")
    if seconds <= lead:
        raise ValueError(f"--time {time}: the job gets USR1 {lead} s before its end (--signal="
                         f"{template_value(text, 'signal')}) to checkpoint; give more wall time than that")
    return time


def header_values(s: Script, text: str) -> dict[str, str | None]:
    """The #SBATCH keys written (None: the template's line kept)."""
    return {"job-name": f"hpctrain-{Path(s.config).stem}", "nodes": str(s.nodes),
            "ntasks-per-node": str(s.ranks_per_node),
            "gpus-per-node": str(s.gpus_per_node) if s.gpus_per_node else None,
            "cpus-per-task": str(s.cpus_per_task) if s.cpus_per_task else None,
            "time": check_time(s, text), "partition": s.partition, "account": s.account}


def header(lines: list[str], values: dict, cpu: bool) -> list[str]:
    """The #SBATCH block with `values` written in place (or appended after its last line)."""
    out, done, last = [], set(), 0
    for line in lines:
        m = SBATCH.match(line)
        key = m.group(2) if m else None
        if key in values and values[key] is not None:
            line = f"#SBATCH --{key}={values[key]}"
            done.add(key)
        elif m and m.group(1) == "#" and (key in CONFLICTS or (cpu and key == "gpus-per-node")):
            line = "#" + line
        out.append(line)
        last = len(out) if m else last
    extra = [f"#SBATCH --{k}={v}" for k, v in values.items() if v is not None and k not in done]
    return out[:last] + extra + out[last:]


def render(s: Script, text: str, file: str, source: str, command: str) -> str:
    """The template (`text`, read from `source`) with the plan's #SBATCH lines, config and flags;
    `command`: the plan command that wrote it, kept in a comment."""
    values = header_values(s, text)
    lines = text.splitlines()
    body = next(i for i, x in enumerate(lines) if i and x.strip() and not x.startswith("#"))
    top = [f"# Written from {source} by hpctrain/plan/sbatch.py: python -m hpctrain plan {command}",
           f"# {s.nodes} node(s) x {s.ranks_per_node} rank(s)"
           + (f", one per GPU ({s.gpus_per_node} GPUs per node)" if s.gpus_per_node else ", CPU ranks")
           + f", the recommended layout {s.layout}.",
           f"# Submit it as it is: sbatch {file}   (arguments after it are config overrides and win)",
           "# The template's notes follow; its #SBATCH lines and CONFIG line below are the plan's.", "#"]
    out = lines[:1] + top + header(lines[1:body], values, not s.gpus_per_node) + lines[body:]
    command = ("# hpctrain plan: the training config and the recommended layout's flags; arguments\n"
               "# given to `sbatch FILE` follow them (a later --section.key=value wins).\n"
               f"CONFIG={shlex.quote(s.config)}\nset -- {s.flags} \"$@\"\n")
    return COMMAND.sub(lambda _: command, "\n".join(out) + "\n", count=1)


def write(target: Path, text: str, force: bool) -> None:
    """`text` into `target` atomically (a temporary file in its folder, then renamed), mode 0755;
    without `force` never over a file that appeared meanwhile."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        if force:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # fails if the file exists: no overwrite in a race
    except FileExistsError:
        raise ValueError(f"--sbatch {target}: the file exists; give --force to replace it") from None
    except OSError as e:
        raise ValueError(f"--sbatch {target}: cannot write it ({e.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def directives(text: str) -> list[str]:
    """The active #SBATCH options of a script, as `--key=value`."""
    return [line.split(None, 1)[1] for line in text.splitlines()
            if SBATCH.match(line) and line.startswith("#SBATCH")]
