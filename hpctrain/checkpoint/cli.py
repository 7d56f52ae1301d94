"""`python -m hpctrain ckpt list|verify`: inspect checkpoints from a shell (one process, no MPI).

Owns turning a user-given path (a run directory, a checkpoint root, or one `step_N` directory) into
checkpoint directories (`resolve_checkpoint`: the one used by sample and export too), and printing their status. It must never modify a checkpoint and never
unpickle anything (it goes through disk_format.check_checkpoint and safe_load).

    ckpt list RUN_DIR [--full]      every step_* directory: step, status, commit time, size, problem
    ckpt verify DIR [--quick]       exit 0 if DIR (or every checkpoint under it) is committed and
                                    intact (every file against its checksum; --quick: sizes and
                                    the small files only), else 1 with one line per problem
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpctrain.checkpoint import directory, disk_format
from hpctrain.checkpoint.disk_format import CheckpointError


def resolve_root(path: str | Path) -> Path:
    """A run dir (has checkpoints/) or a checkpoint root -> the checkpoint root."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory")
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def is_checkpoint_dir(p: Path) -> bool:
    return (p / disk_format.COMMIT_FILE).exists() or disk_format.parse_dir_name(p.name) is not None


def resolve_checkpoint(path: str | Path, use: str = "sample") -> Path:
    """The one answer to "which checkpoint does this path mean" (`use`: sample, export, load): a step
    dir (COMMIT.json, or a step_N name) as given; under a run dir or a checkpoint root the newest
    committed and intact one (damaged newer ones are skipped with one warning line each;
    NoIntactCheckpoint when none is intact). CheckpointError naming the path when it is missing,
    not a directory, or holds no checkpoint."""
    p = Path(path)
    if p.is_dir() and is_checkpoint_dir(p):
        return p
    found, _ = directory.find_latest(resolve_root(p), use=use)
    if found is None:
        raise CheckpointError(f"{p}: no committed checkpoint found")
    return found


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_list(args) -> int:
    root = resolve_root(args.dir)
    infos = directory.list_checkpoints(root, full=args.full)
    if not infos:
        print(f"{root}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'status':<10} {'kind':<10} {'committed (UTC)':<25} {'size':>10}  path")
    for i in infos:
        print(f"{i.step:>10}  {i.status:<10} {i.kind:<10} {i.time or '-':<25} "
              f"{_size(i.size_bytes):>10}  {i.path}")
        for problem in i.problems if i.status != "committed" else []:
            print(f"{'':>12}{problem}")
    latest, _ = directory.find_latest(root)
    print(f"latest: {latest if latest else 'none (nothing to resume from)'}")
    return 0


def cmd_verify(args) -> int:
    p = Path(args.dir)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such directory")
    if is_checkpoint_dir(p):
        targets = [p]
    else:
        targets = [path for _, kind, path in directory.scan(resolve_root(p)) if kind == "checkpoint"]
        if not targets:
            raise CheckpointError(f"{p}: no checkpoints (expected a step_N directory, a checkpoint "
                                  f"root or a run directory)")
    bad = 0
    for t in targets:
        problems = disk_format.verify_checkpoint(t, full=not args.quick)
        if problems:
            bad += 1
            for problem in problems:
                print(f"{t}: {problem}")
        else:
            commit = disk_format.read_commit(t)
            how = "every file checksummed" if not args.quick and commit.get("checksums") == "full" \
                else "sizes + small-file sha256" + ("" if args.quick else
                                                   " (no data checksums recorded)")
            print(f"{t}: intact (step {commit['step']}, world size {commit['world_size']}, {how})")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpctrain ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="list checkpoints with their status")
    p.add_argument("dir", help="run directory or checkpoint root")
    p.add_argument("--full", action="store_true", help="also check data-file checksums")
    p = sub.add_parser("verify", help="check one checkpoint (or all under a root); exit 1 if bad")
    p.add_argument("dir", help="step_N directory, checkpoint root or run directory")
    p.add_argument("--quick", action="store_true",
                   help="sizes and small-file checksums only (skip re-reading the tensor data)")
    p.add_argument("--full", action="store_true", help=argparse.SUPPRESS)  # the default now
    args = parser.parse_args(argv)
    return {"list": cmd_list, "verify": cmd_verify}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
