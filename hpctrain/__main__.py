"""`python -m hpctrain train|sample|plot|ckpt|export|tune|plan` (console script `hpctrain`): thin dispatch only."""
from __future__ import annotations

import argparse
import sys

from hpctrain import signals

signals.install(signals.EARLY)  # before torch loads: a forwarded preemption USR1 must not kill us
from hpctrain import logs  # noqa: E402
from hpctrain.distributed import run_or_abort  # noqa: E402

TRAIN_EPILOG = """\
Every config key can be given in the TOML file or overridden on the command line as
--section.key=value (or --section.key value). Unknown keys are errors, and so are numbers no key
takes: nan or inf, integers beyond 64 bits, keys in seconds (*_s) below 0 or above 604800 (7 days).
Keys:
{keys}

Launch: `python -m hpctrain train ...` runs one rank; `mpiexec -n N python -m hpctrain train ...` or
`srun python -m hpctrain train ...` runs N ranks. Rerunning the same command resumes from the newest
committed checkpoint in the run directory.
"""


def _train(argv: list[str]) -> int:
    from hpctrain import config

    parser = argparse.ArgumentParser(
        prog="hpctrain train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GPT on sharded data with MPI-launched data parallelism.",
        epilog=TRAIN_EPILOG.format(keys=config.describe()))
    parser.add_argument("--config", help="TOML config file (see configs/)")
    from hpctrain.train.dry_run_cli import DRY_RUN_HELP

    parser.add_argument("--dry-run", type=int, metavar="N", help=DRY_RUN_HELP)
    parser.add_argument("--json", action="store_true", help="with --dry-run: the report as JSON")
    args, overrides = parser.parse_known_args(argv)
    cfg = config.load(args.config, overrides)  # config errors surface before MPI starts
    if args.dry_run is not None:  # one process, no MPI (hpctrain/train/dry_run.py)
        from hpctrain.train.dry_run_cli import run_dry

        return run_dry(cfg, args.dry_run, args.json)
    from hpctrain.metrics.wandb_log import check_installed

    check_installed(cfg)  # metrics.wandb = true needs the extra: said before MPI starts too

    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.distributed.preempt import install_signal_handlers, requeue_if_requested
    from hpctrain.train.loop import train

    install_signal_handlers(cfg.slurm.signals)  # early: an uncaught SIGUSR1 would kill the rank
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s,
                           cpu_collectives=cfg.parallel.offload == "all")
    if cfg.train.objective == "dpo":  # preference pairs, the DPO loss (hpctrain/train/dpo.py)
        from hpctrain.train.dpo import DpoTrainer

        status = train(cfg, ctx, DpoTrainer)
    else:  # an exception skips teardown's barrier: run_or_abort aborts all ranks
        status = train(cfg, ctx)
    teardown()
    requeue_if_requested(ctx.comm)  # after a preemption stop: MPI finalized, then scontrol requeue
    return status


def _sample(argv: list[str]) -> int:
    from hpctrain.sample import main as sample_main

    return sample_main(argv)


def _eval(argv: list[str]) -> int:
    from hpctrain.evaluate import main as eval_main

    return eval_main(argv)


def _lm_eval(argv: list[str]) -> int:
    try:
        from hpctrain.lm_eval_model import main as lm_eval_main  # registers --model hpctrain
    except ImportError as e:
        from hpctrain.errors import UserError

        raise UserError(f"hpctrain lm-eval needs lm_eval ({e}): pip install -e '.[eval]'") from None
    return lm_eval_main(argv)


def _plot(argv: list[str]) -> int:
    from hpctrain.metrics.plot import main as plot_main

    return plot_main(argv)


def _ckpt(argv: list[str]) -> int:
    from hpctrain.checkpoint.cli import main as ckpt_main

    return ckpt_main(argv)


def _export(argv: list[str]) -> int:
    from hpctrain.export import main as export_main

    return export_main(argv)


def _plan(argv: list[str]) -> int:
    if "--verify" in argv:  # + the dry run of the recommended layout (hpctrain/train/dry_run_cli.py)
        from hpctrain.train.dry_run_cli import verify_plan

        return verify_plan(argv)
    from hpctrain.plan.cli import main as plan_main

    return plan_main(argv)


def _tune(argv: list[str]) -> int:
    from hpctrain.tune.cli import main as tune_main

    return tune_main(argv)


def _doctor(argv: list[str]) -> int:
    from hpctrain.doctor import main as doctor_main

    return doctor_main(argv)


COMMANDS = {"train": _train, "sample": _sample, "eval": _eval, "lm-eval": _lm_eval, "plot": _plot, "ckpt": _ckpt, "export": _export,
            "tune": _tune, "plan": _plan, "doctor": _doctor}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m hpctrain {train,sample,eval,lm-eval,plot,ckpt,export,tune,plan,doctor} [-h] ...\n\n"
              "  train   train a GPT (mpiexec/srun for several ranks); resumes automatically\n"
              "  sample  generate text from a checkpoint\n"
              "  eval    RUN_OR_HF_DIR --data DATASET: loss, perplexity, bits per byte (mpiexec: "
              "split over ranks)\n"
              "  lm-eval lm_eval's command line with --model hpctrain --model_args path=RUN_DIR "
              "(the `eval` extra)\n"
              "  plot    PNG of loss, val loss, lr, tokens/s and MFU of a run\n"
              "  ckpt    list RUN_DIR | verify DIR: checkpoint status and integrity\n"
              "  export  --checkpoint DIR --format hf --output OUT: a Hugging Face model folder (GPT-2,\n"
              "          Llama, Qwen2, Mixtral or Qwen2-MoE, as the checkpoint's model is)\n"
              "  tune    search CONFIG.toml | status JOURNAL: Bayesian search (Optuna) over Slurm "
              "arrays;\n          pbt CONFIG.toml (under mpiexec) | pbt-plot RUN_DIR: population-based "
              "training\n"
              "  plan    per-rank memory, communication, checkpoint and data figures of a model "
              "and layout at scale\n"
              "  doctor  RUN: which rank was where when a run hung or lost a rank (its forensics)",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logs.setup()  # the launcher's rank until init_distributed knows it (train, tune pbt)
    return run_or_abort(COMMANDS[argv[0]], argv[1:])


def exit_without_teardown(status: int) -> None:
    """End a finished `train` (or `sample`, `export`, `ckpt`) process at once: flush, finalize MPI,
    tell the launcher, os._exit. Everything the run wrote is committed and closed by now
    (checkpoint, metrics, TensorBoard, process group; an export's files, written with `with`);
    what os._exit skips is the interpreter freeing every module and object one by one, which takes
    0.8 s after torch.distributed has been imported (measured here) on every rank
    of every job. Where the launcher cannot be told (hpctrain/distributed/launcher_exit.py), the
    process exits through the interpreter instead."""
    import logging
    import os

    from hpctrain.distributed.launcher_exit import tell_launcher_finalized

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    if tell_launcher_finalized():
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] in (["train"], ["sample"], ["export"], ["ckpt"]) and isinstance(status, int):
        exit_without_teardown(status)  # their files are written and closed by now
    sys.exit(status)
