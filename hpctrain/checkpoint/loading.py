"""Loading a checkpoint (the manager's `load`): rank 0 checks the directory and reads its JSON
files, every rank gets them, DCP reads the tensors (resharded to this job's layout; only tensors:
safe_load.py) while each rank re-checks its share of the data checksums (verify.py), and any
failure on any rank becomes the same one-line CheckpointError on every rank.

Every collective here, DCP's own included, runs on the manager's gloo save group (its long
timeout; manager.py): ranks that read and hash at different speeds on a busy file system wait for
each other on host sockets, never in an NCCL collective under dist.timeout_s.
"""
from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

from hpctrain.checkpoint import disk_format, faults
from hpctrain.checkpoint.dcp_io import describe, failure
from hpctrain.checkpoint.state import merge_values, split_state
from hpctrain.checkpoint.verify import ShareVerifier
from hpctrain.errors import CheckpointError


@contextmanager
def quiet(dist_on: bool):
    """Without a process group DCP warns that it assumes one process: that is our intent."""
    with warnings.catch_warnings():
        if not dist_on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load(ranks, path: Path, state: dict) -> tuple[dict, ShareVerifier]:
    """Collective. Checkpoint `path` into `state` in place; (the saved JSON state, this rank's
    checksum verifier: what it hashed and how long it waited). `ranks`: the CheckpointManager
    (its agreement, on its save group)."""
    import torch.distributed.checkpoint as dcp  # imported by the manager's import_dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hpctrain.checkpoint.safe_load import SafeFileSystemReader, TensorOnlyLoadPlanner

    prefix = f"checkpoint load from {path}"
    group = ranks.save_group()  # every collective below (module docstring)
    payload = None
    if ranks.rank == 0:
        faults.hit("load.begin", path)
        try:
            problems, commit, metadata = disk_format.check_checkpoint(path)
            if problems:
                raise CheckpointError("; ".join(problems))
            json_state = json.loads((path / disk_format.TRAINER_STATE_FILE).read_bytes())
            values = json.loads((path / disk_format.NONTENSOR_FILE).read_bytes())
            payload = ("ok", (metadata, json_state, values, commit["files"]))
        except Exception as e:  # noqa: BLE001
            payload = ("error", describe(e))
    status, value = ranks._bcast(payload)
    if status == "error":
        raise CheckpointError(f"{prefix} failed: {value}")
    metadata, json_state, values, files = value

    # this rank's share of the data checksums, hashed while DCP reads (verify.py)
    verifier = ShareVerifier(path, files, ranks.rank, ranks.world_size)
    err = None
    try:  # the target state: agreed before entering DCP's collectives
        tensors, _ = split_state(state)
    except Exception as e:  # noqa: BLE001
        err = failure(e, ranks.rank)
    ranks._agree(err, prefix)
    try:
        reader = SafeFileSystemReader(path, metadata=metadata)
        with quiet(ranks._dist):
            dcp.load(tensors, storage_reader=reader, planner=TensorOnlyLoadPlanner(),
                     process_group=group, no_dist=not ranks._dist)
        faults.hit("load.dcp_done", path)
        merge_values(state, values, str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        err = failure(e, ranks.rank)
    err = verifier.problem() or err  # a damaged file: named, whatever DCP made of it
    try:
        ranks._agree(err, prefix)
    except CheckpointError as e:
        e.state_written = True  # DCP reads into `state` in place: part of it may hold this checkpoint's
        raise
    return json_state, verifier
