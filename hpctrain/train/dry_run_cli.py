"""`hpctrain train --dry-run N` and `hpctrain plan --verify`: the dry run from the command line.

Owns: turning the options into a dry run (train/dry_run.py) and printing its report
(train/dry_run_report.py): the table on stdout, or `--json`; for `plan --verify`, the
recommended layout of the plan (its `--parallel.*` / `--train.*` flags over the config) dry-run at
the plan's world size after the plan's report. It must never compute a figure itself.
"""
from __future__ import annotations

import json
import shlex
import sys

from hpctrain import logs
from hpctrain.config import Config

DRY_RUN_HELP = (
    "build the model on this config's layout for N GPU ranks on this machine and run 2 training "
    "steps (forward, backward, clip, optimizer) as rank 0 (and, in a process of its own, the last "
    "pipeline stage's first rank): fake GPU tensors (shapes only) and a fake process group; no data, checkpoint, "
    "MPI or GPU. Prints per rank the parameter, gradient, optimizer-state and peak bytes beside "
    "`hpctrain plan`'s figures (--json: as one JSON line). A CPU tensor reaching a collective or meeting a "
    "GPU tensor is one error line naming the op")


def run_dry(cfg: Config, world: int, as_json: bool) -> int:
    """The dry run's table, or with `as_json` its JSON on one line."""
    from hpctrain.train.dry_run import dry_run
    from hpctrain.train.dry_run_report import as_dict, render

    report = as_dict(cfg, world, dry_run(cfg, world))
    print(json.dumps(report) if as_json else render(report), end="\n" if as_json else "")
    return 0


def verify_plan(argv: list[str]) -> int:
    """`plan ... --verify`: the plan's report, then the dry run of its recommended layout."""
    from hpctrain import config
    from hpctrain.plan import cli, recommend, search
    from hpctrain.plan.shape import PRESET_CONFIGS

    argv = [a for a in argv if a != "--verify"]
    status = cli.main(argv)
    if status:
        return status
    args = cli.build_parser().parse_args(argv)
    path = args.config or PRESET_CONFIGS.get(args.preset, (None,))[0]
    if path is None:
        logs.error("error: --verify dry-runs a training config: give --config (or a --preset "
                   "with a shipped config)")
        return 2
    shape, job = cli.shape_and_job(args)
    best = recommend.advise(shape, job).best
    if best is None:
        logs.error(f"error: --verify: no layout fits {job.nodes} node(s): nothing to dry-run")
        return 2
    flags = shlex.split(search.train_flags(best.job))
    if not args.json:  # --json: the plan's JSON line, then the dry run's
        print(f"\n## --verify: the dry run of the recommended layout ({best.job.world} ranks)\n")
    sys.stdout.flush()
    return run_dry(config.load(path, flags), best.job.world, args.json)
