"""Rank-aware logging of hpctrain and data_tools on the standard `logging` module.

Owns: the one handler of the "hpctrain" and "data_tools" loggers (stderr), which ranks emit INFO
and DEBUG lines, the level, and the line format. Diagnostics, progress and warnings go through it;
`print` is left for a command's own output (tables, JSON, sampled text). hpctrain/logs.py
re-exports it (data_tools never imports hpctrain).

    from data_tools import logs        # or: from hpctrain import logs
    log = logs.get_logger(__name__)    # a module's logger; or logs.info(msg) / logs.warning(msg)

Environment:
  HPCTRAIN_LOG_RANKS   ranks that log INFO/DEBUG lines: 0 (default), all, or a list like 0,3.
                       Warnings and errors are logged on every rank.
  HPCTRAIN_LOG_LEVEL   DEBUG, INFO (default), WARNING or ERROR.

Format: the bare message on rank 0 while only rank 0 logs INFO (the lines as they always were);
"[rank N] message" on any other rank, and on every rank once several ranks log INFO.
`setup(rank, world_size)` is called where the rank becomes known (hpctrain's init_distributed,
data_tools' MPI commands); before that the launcher's rank variables stand in (else rank 0).
"""
from __future__ import annotations

import logging
import os
import sys

RANKS_VAR = "HPCTRAIN_LOG_RANKS"
LEVEL_VAR = "HPCTRAIN_LOG_LEVEL"
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR}
ROOTS = ("hpctrain", "data_tools")
# rank and size as MPICH/Hydra, Open MPI, PMIx and srun give them, before MPI is initialized
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")

_configured: list = []  # [(rank, world_size)] once setup ran


class _StderrNow(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (a redirect or pytest's capture included)."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


class _RankFilter(logging.Filter):
    """Warnings and errors pass on every rank; INFO and DEBUG only on the ranks that log them."""

    def __init__(self, logs_info: bool):
        super().__init__()
        self.logs_info = logs_info

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or self.logs_info


def _env_int(names: tuple, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def _parse_ranks(text: str, world_size: int) -> tuple[set, str | None]:
    """(the ranks that log INFO, a warning about `text` or None)."""
    text = text.strip().lower()
    if text in ("", "0"):
        return {0}, None
    if text == "all":
        return set(range(world_size)), None
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        ranks = set()
    if not ranks or min(ranks) < 0:
        return {0}, (f"warning: {RANKS_VAR}={text!r} is not 'all' or a list of ranks like 0,3; "
                     f"only rank 0 logs")
    return ranks, None


def _parse_level(text: str) -> tuple[int, str | None]:
    name = text.strip().upper() or "INFO"
    if name in LEVELS:
        return LEVELS[name], None
    return logging.INFO, (f"warning: {LEVEL_VAR}={text!r} is not one of {', '.join(LEVELS)}; "
                          f"using INFO")


def setup(rank: int | None = None, world_size: int | None = None) -> None:
    """(Re)configure the loggers for this process: `rank` of `world_size` (None: the launcher's
    environment variables, else rank 0 of 1). Reads HPCTRAIN_LOG_RANKS and HPCTRAIN_LOG_LEVEL."""
    rank = _env_int(_RANK_VARS, 0) if rank is None else rank
    world_size = _env_int(_SIZE_VARS, 1) if world_size is None else world_size
    ranks, ranks_problem = _parse_ranks(os.environ.get(RANKS_VAR, ""), world_size)
    level, level_problem = _parse_level(os.environ.get(LEVEL_VAR, ""))
    several = len(ranks & set(range(world_size))) > 1
    prefix = f"[rank {rank}] " if rank != 0 or several else ""
    handler = _StderrNow()
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(message)s"))
    handler.addFilter(_RankFilter(rank in ranks))
    for name in ROOTS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _StderrNow)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # an application's root handler would print each line twice
    first = not _configured
    _configured[:] = [(rank, world_size)]
    for problem in (ranks_problem, level_problem) if first and rank == 0 else ():
        if problem:
            logging.getLogger(ROOTS[0]).warning(problem)


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (under "hpctrain." or "data_tools."), configured on first use."""
    if not _configured:
        setup()
    return logging.getLogger(name)


def debug(msg: str) -> None:
    get_logger(ROOTS[0]).debug(msg)


def info(msg: str) -> None:
    """`msg` on the ranks that log INFO (rank 0 by default)."""
    get_logger(ROOTS[0]).info(msg)


def warning(msg: str) -> None:
    """`msg` on every rank that calls it."""
    get_logger(ROOTS[0]).warning(msg)


def error(msg: str) -> None:
    get_logger(ROOTS[0]).error(msg)
