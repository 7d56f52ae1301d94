"""`python -m hpctrain tune search|status|pbt|pbt-plot`: argument parsing only (docs/tuning.md)."""
from __future__ import annotations

import argparse
import shlex

SEARCH_EPILOG = """\
The [tune] section of CONFIG.toml gives the study and the search space:
{keys}
  tune.params.<section>.<key> = {{ log_uniform = [lo, hi] }} | {{ uniform = [lo, hi] }} |
                                {{ int = [lo, hi], step = k }} | {{ choice = [a, b, ...] }}

Each worker asks the study (an Optuna journal file) for a trial, trains it in <journal dir>/trial_<n>
with `--launch PREFIX python -m hpctrain train --config CONFIG.toml [overrides] <the trial's values>`,
reports its validation losses, stops it when pruned, and goes on until the study has tune.n_trials
trials. Run any number at once (slurm/tune.sbatch: one per array task). Preempted (USR1/TERM, or the
training exits 75), a worker keeps its trial, requeues its own Slurm task and exits 75; requeued, it
resumes that trial from its checkpoint.
"""

PBT_EPILOG = """\
mpiexec -n P*k python -m hpctrain tune pbt CONFIG.toml [--section.key=value ...]
splits the ranks into tune.pbt.population = P members of k ranks (each in the [parallel] layout),
trains member i in <run.dir>/member_<i>, and every tune.pbt.ready steps lets the worst quantile copy
a best member's weights and optimizer state and perturb its values within the [tune.params] bounds
(train.lr, min_lr, warmup_steps, weight_decay, grad_clip, beta1, beta2). Lineage: <run.dir>/lineage.jsonl.
Rerun the same command to resume after a stop (USR1/TERM, train.stop_at_step).
"""


def main(argv: list[str]) -> int:
    from hpctrain.tune import space

    parser = argparse.ArgumentParser(prog="hpctrain tune", description="Bayesian hyperparameter "
                                     "search (Optuna) over Slurm job arrays; population-based "
                                     "training inside one MPI job.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="one search worker: ask, train, report, prune, tell; repeat",
                       epilog=SEARCH_EPILOG.format(keys=space.describe()))
    s.add_argument("config", help="training TOML with a [tune] section")
    s.add_argument("--launch", default="", help="command prefix that starts a trial's ranks, e.g. "
                   "'srun --mpi=pmi2 --kill-on-bad-exit=1' or 'mpiexec -n 4' (default: one rank, "
                   "no launcher)")
    s.add_argument("--worker", help="this worker's name, which keeps its trial across a restart "
                   "(default: <array job>_<task> in Slurm, else 'local')")
    st = sub.add_parser("status", help="the table of trials and the best configuration as TOML")
    st.add_argument("journal", help="the study's journal file ([tune] journal)")
    st.add_argument("--study", help="study name (default: the journal's only study)")
    st.add_argument("--toml", help="write the best configuration here instead of printing it")
    p = sub.add_parser("pbt", help="population-based training: mpiexec -n P*k ... tune pbt CONFIG",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PBT_EPILOG)
    p.add_argument("config", help="training TOML with [tune.params] (bounds) and [tune.pbt]")
    pp = sub.add_parser("pbt-plot", help="PNG of a PBT run: per-member losses and values")
    pp.add_argument("run_dir", help="the population's run.dir (lineage.jsonl, member_<i>/)")
    pp.add_argument("--output", "-o", help="PNG path (default: RUN_DIR/pbt.png)")
    args, overrides = parser.parse_known_args(argv)
    if args.command == "pbt":
        from hpctrain.tune.pbt_job import pbt

        return pbt(args.config, overrides)
    if args.command == "pbt-plot":
        from hpctrain.tune.pbt_plot import plot_population

        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        print(plot_population(args.run_dir, args.output))
        return 0
    if args.command == "status":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        from hpctrain.tune.status import status

        return status(args.journal, args.study, args.toml)
    from hpctrain.tune.search import search

    return search(args.config, overrides, shlex.split(args.launch), args.worker)
