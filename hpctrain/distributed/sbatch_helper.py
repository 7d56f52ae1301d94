"""What the sbatch templates ask before they start any rank: which launcher, and may this job start.

    python -m hpctrain.distributed.sbatch_helper launcher
        one line `LAUNCHER SRUN_MPI MPIEXEC WHY...` for `read -r` in the templates
    python -m hpctrain.distributed.sbatch_helper check CONFIG.toml [--section.key=value ...]
        exit 0, or one `error: ...` line and exit 2: a bad config, or a Slurm time limit that leaves
        no time to train (hpctrain/distributed/preempt.py, `time_limit_error`)

Owns the launcher choice. The PyPI `mpich` wheel needs its own `mpiexec` (Hydra, which starts its
proxies through srun inside an allocation): under `srun --mpi=pmi2` Slurm 22.05's PMI server cuts
the wheel's long PMI lines and MPI_Init fails or hangs (docs/multinode.md). Any other MPI (a site
MPI, or Open MPI loaded through MPI4PY_LIBMPI) gets `srun`, with `--mpi=pmix` for Open MPI and
`--mpi=pmi2` for the rest. HPCTRAIN_LAUNCHER and HPCTRAIN_SRUN_MPI override. The library is found
without initializing MPI (mpi4py.rc.initialize = False): the batch shell is no MPI process.

Checking once in the batch shell prints a config error once, before any launcher can kill rank 0
on another rank's exit (`srun --kill-on-bad-exit`) and lose its line. It must never import torch.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

WHEELS = ("mpich",)  # PyPI MPI wheels whose own mpiexec must start the ranks


def loaded_libmpi() -> tuple[str, str]:
    """(path of the libmpi mpi4py loads, its vendor) without MPI_Init; ("", "") when unknown."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "/libmpi" in line]
    return (paths[0] if paths else ""), vendor


def wheel_mpiexec(libmpi: str) -> tuple[str, str] | None:
    """(wheel name, its mpiexec) when `libmpi` is a file of an installed PyPI MPI wheel."""
    from importlib import metadata

    if not libmpi:
        return None
    real = Path(libmpi).resolve()
    for name in WHEELS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        files = [Path(dist.locate_file(f)).resolve() for f in dist.files or ()]
        if real in files:
            mpiexec = next((str(f) for f in files if f.name == "mpiexec"), "mpiexec")
            return name, mpiexec
    return None


def choose_launcher(env: dict | None = None) -> tuple[str, str, str, str]:
    """(launcher, srun --mpi plugin, mpiexec to run, why) for the MPI that mpi4py loads."""
    env = os.environ if env is None else env
    try:
        libmpi, vendor = loaded_libmpi()
    except Exception as e:  # noqa: BLE001 - no mpi4py, a broken MPI: the ranks will say it
        libmpi, vendor, failure = "", "", f"cannot tell which MPI mpi4py loads ({e})"
    else:
        failure = ""
    srun_mpi = env.get("HPCTRAIN_SRUN_MPI") or ("pmix" if vendor == "Open MPI" else "pmi2")
    wheel = wheel_mpiexec(libmpi)
    mpiexec = wheel[1] if wheel else (shutil.which("mpiexec", path=env.get("PATH")) or "mpiexec")
    given = env.get("HPCTRAIN_LAUNCHER")
    if given:
        return given, srun_mpi, mpiexec, f"HPCTRAIN_LAUNCHER={given}"
    if wheel:
        return ("mpiexec", srun_mpi, mpiexec,
                f"mpi4py loads the PyPI {wheel[0]} wheel ({libmpi}): its own mpiexec (Slurm's "
                f"pmi2 cuts the wheel's long PMI lines); HPCTRAIN_LAUNCHER=srun overrides")
    why = failure or f"mpi4py loads {vendor or 'an MPI'} from {libmpi or '?'} (not a PyPI wheel)"
    return "srun", srun_mpi, mpiexec, f"{why}: srun --mpi={srun_mpi}; HPCTRAIN_LAUNCHER=mpiexec overrides"


def check(argv: list[str]) -> int:
    """Load the config as `train` would and refuse a time limit that leaves no time to train."""
    from hpctrain import config, logs
    from hpctrain.distributed import preempt, slurm
    from hpctrain.errors import UserError

    if not argv:
        print("error: usage: sbatch_helper check CONFIG.toml [--section.key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = config.load(argv[0], argv[1:])
        job = slurm.SlurmJob.from_env()
        margin = cfg.slurm.time_margin_s
        limit = slurm.time_limit_seconds(job) if job is not None and margin > 0 else None
        err = preempt.time_limit_error(job, limit, margin, cfg.run.dir)
        if err:
            raise UserError(err)
    except UserError as e:
        logs.error(f"error: {e}")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launcher"]:
        print(" ".join(choose_launcher()), flush=True)
        return 0
    if argv[:1] == ["check"]:
        return check(argv[1:])
    print("usage: python -m hpctrain.distributed.sbatch_helper launcher | check CONFIG.toml "
          "[--section.key=value ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
