"""Slurm runtime glue: what job this is, how much wall time is left, and requeueing it.

Owns: reading `SLURM_*` variables (job id, array task, node list, restart count, tasks), asking the
controller for the time limit, the remaining wall time and whether the job may be requeued
(`squeue`, `scontrol show job`), `scontrol requeue` (an array task by `<array job>_<task>`), whether a job has ended, and
refusing a launch that `srun` started without an MPI plugin (every task
would train alone). It must never import torch, model, data or checkpoint code, and it never decides
*when* to stop: that is preempt.py's job. Outside Slurm every function here
answers "not in Slurm" and does nothing.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from hpctrain.errors import UserError

SLURM_CMD_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class SlurmJob:
    """This process's Slurm job, from the environment (None fields when not set)."""

    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    nodelist: str
    n_nodes: int
    restart_count: int
    step_tasks: int | None   # tasks in this job step (srun), None in the batch shell / mpiexec

    @classmethod
    def from_env(cls, env: dict | None = None) -> "SlurmJob | None":
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        steps = env.get("SLURM_STEP_NUM_TASKS")
        return cls(job_id=job_id,
                   array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
                   array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
                   nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "?",
                   n_nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
                   restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
                   step_tasks=int(steps) if steps and steps.isdigit() else None)

    @property
    def slurm_id(self) -> str:
        """The id to give scontrol / squeue for this job: `<array job>_<task>` for an array task.
        An array task's own SLURM_JOB_ID may equal the array's job id, which names the whole
        array: `scontrol requeue` of it would requeue every task."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def name(self) -> str:
        """`123` or, for an array task, `120_3 (job 123)`."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id} (job {self.job_id})"
        return self.job_id

    def describe(self) -> str:
        return (f"slurm: job {self.name}, restart {self.restart_count}, "
                f"{self.n_nodes} node{'s' if self.n_nodes != 1 else ''} {self.nodelist}")


def check_launch(world_size: int, env: dict | None = None) -> None:
    """Refuse `srun -n N` (N > 1) without an MPI plugin: each task would be a world of one rank."""
    env = os.environ if env is None else env
    job = SlurmJob.from_env(env)
    if job is None or job.step_tasks is None or "SLURM_STEP_ID" not in env:
        return
    if world_size == 1 and job.step_tasks > 1:
        raise UserError(
            f"srun started {job.step_tasks} tasks but MPI sees a world of 1 (SLURM_STEP_NUM_TASKS="
            f"{job.step_tasks}): launch with `srun --mpi=pmi2` (MPICH) or `srun --mpi=pmix` "
            f"(Open MPI), or use mpiexec inside the allocation")


def _run(args: list[str]) -> str | None:
    """stdout of a Slurm command, or None when it is missing or fails (never raises)."""
    if shutil.which(args[0]) is None:
        return None
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_duration(text: str) -> float | None:
    """Slurm's `[days-][hours:]minutes:seconds` (also `minutes`) -> seconds; None for
    UNLIMITED / NOT_SET / INVALID / empty."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        return None
    days = int(m.group(1) or 0)
    parts = [int(p) for p in m.group(2, 3, 4) if p is not None]
    if m.group(1) is not None:          # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        h, mi, s = parts
    elif len(parts) == 3:
        h, mi, s = parts
    elif len(parts) == 2:
        h, (mi, s) = 0, parts
    else:
        h, mi, s = 0, parts[0], 0       # bare number = minutes
    return float(((days * 24 + h) * 60 + mi) * 60 + s)


def remaining_seconds(job: SlurmJob | None, env: dict | None = None) -> float | None:
    """Wall time left to the job, or None when unknown or unlimited.

    `SLURM_JOB_END_TIME` (newer Slurm sets it) when present, else `squeue -h -j ID -o %L`, which
    also sees a time limit changed while the job runs."""
    if job is None:
        return None
    env = os.environ if env is None else env
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and int(end) > 0:
        return int(end) - time.time()
    out = _run(["squeue", "-h", "-j", job.slurm_id, "-o", "%L"])
    return parse_duration(out.splitlines()[0]) if out and out.strip() else None


def job_fields(job: SlurmJob) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict (empty when the controller cannot be asked)."""
    out = _run(["scontrol", "show", "job", "-o", job.slurm_id]) or ""
    fields = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def time_limit_seconds(job: SlurmJob | None) -> float | None:
    """The job's time limit (`TimeLimit` of `scontrol show job`) in seconds; None when unlimited
    or unknown."""
    if job is None:
        return None
    return parse_duration(job_fields(job).get("TimeLimit", ""))


def requeue_allowed(job: SlurmJob | None) -> tuple[bool, str]:
    """(may we requeue, why not) for `slurm.requeue = auto`: a batch job submitted with requeue."""
    if job is None:
        return False, "not running inside a Slurm job"
    f = job_fields(job)
    if not f:
        return False, f"cannot read job {job.slurm_id} from the controller (scontrol show job)"
    if f.get("BatchFlag") != "1":
        return False, f"job {job.job_id} is not a batch job (srun/salloc)"
    if f.get("Requeue") != "1":
        return False, f"job {job.job_id} does not allow requeue (submitted with --no-requeue)"
    return True, ""


ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def job_ended(slurm_id: str) -> bool | None:
    """Whether job `123` (or array task `120_3`) has ended for good: True when the controller says
    it is in an end state or no longer knows it; False while it is queued, running or requeued;
    None when the controller cannot be asked."""
    if shutil.which("scontrol") is None:
        return None
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", slurm_id], capture_output=True,
                           text=True, timeout=SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return True if "Invalid job id" in r.stderr else None
    states = re.findall(r"\bJobState=(\S+)", r.stdout)
    return all(s in ENDED_STATES for s in states) if states else None


def requeue_decision(mode: str, job: SlurmJob | None) -> tuple[bool, str]:
    """`slurm.requeue` (auto | true | false) for this job: (requeue it, why not)."""
    if mode == "false":
        return False, "slurm.requeue=false"
    if mode == "auto":
        return requeue_allowed(job)
    return job is not None, "not running inside a Slurm job"


def requeue(job: SlurmJob) -> tuple[bool, str]:
    """`scontrol requeue JOBID` (Slurm then ends this run and starts the job again; an array task
    alone): (ok, error)."""
    if shutil.which("scontrol") is None:
        return False, "scontrol not found"
    try:
        r = subprocess.run(["scontrol", "requeue", job.slurm_id], capture_output=True, text=True,
                           timeout=SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    # < 0: scontrol was itself ended by the requeue it asked for (it runs inside the job)
    return r.returncode <= 0, (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
