"""A rank's start-up does not import what a plain run (one rank or DDP) does not use: DTensor,
DCP, FSDP, tensor parallelism and the sympy they pull in (~0.6 s CPU per rank; imported on the
first checkpoint save or load, or where the layout needs them). Each rank of every test launch pays
for what `import hpctrain.train.loop` imports, so a win lost here costs minutes of suite time.

What torch itself imports later is not ours to defer: torch.optim.Optimizer's constructor imports
torch._dynamo (and with it sympy, DTensor, FSDP) in torch 2.13; see docs/benchmarks.md (issue 35).
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import run_cmd

# Not imported by `import hpctrain.train.loop` (each ~0.1-0.6 s CPU, or pulled in by one that is)
DEFERRED = ("sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor",
            "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.distributed._functional_collectives", "torch._dynamo",
            "wandb")  # ~0.5 s; only with metrics.wandb = true (hpctrain/metrics/wandb_log.py)


PROBE = """
import json, sys
def heavy():
    return sorted(m for m in sys.modules if m.startswith(%r))
import hpctrain.train.loop, hpctrain.__main__
import torch
from hpctrain.distributed.dtensor import is_dtensor
plain = heavy(), is_dtensor(torch.ones(2)), is_dtensor(None)
import hpctrain.checkpoint.recording_fs, hpctrain.checkpoint.safe_load  # the first save or load
print(json.dumps([*plain, heavy()]))
""" % (DEFERRED,)


@pytest.fixture(scope="module")
def probe():
    """(DEFERRED modules after `import hpctrain.train.loop`, is_dtensor of a tensor and of None,
    the DEFERRED modules once the checkpoint path is imported), from one fresh interpreter."""
    r = run_cmd([sys.executable, "-c", PROBE], timeout=120, check=True)
    at_start, on_tensor, on_none, at_save = json.loads(r.stdout.strip().splitlines()[-1])
    return set(at_start), on_tensor, on_none, set(at_save)


def test_train_loop_import_defers_the_heavy_modules(probe):
    at_start, on_tensor, on_none, _ = probe
    assert at_start == set(), sorted(at_start)[:20]
    assert (on_tensor, on_none) == (False, False)  # and is_dtensor imported nothing either


def test_the_checkpoint_path_still_imports_dcp(probe):
    """The control: the names above are the ones DCP pulls in (a typo would pass the test above)."""
    at_save = probe[3]
    assert {"torch.distributed.checkpoint", "torch.distributed.tensor", "sympy",
            "torch.fx.experimental.symbolic_shapes"} <= at_save, sorted(at_save)[:20]


def test_failure_unwraps_dcp_exceptions_once_dcp_is_imported():
    """dcp_io no longer imports CheckpointException: a relayed DCP failure is still unwrapped to the
    first rank's error and ranked below a rank's own."""
    from torch.distributed.checkpoint.api import CheckpointException

    from hpctrain.checkpoint.dcp_io import describe, failure

    exc = CheckpointException("save failed", {1: (OSError(28, "No space left on device", "/x"), None)})
    assert describe(exc) == "[Errno 28] No space left on device: '/x'"
    assert failure(exc, rank=0) == (1, "[Errno 28] No space left on device: '/x'")  # relayed
    assert failure(exc, rank=1)[0] == 0  # its own
    assert failure(ValueError("bad"), rank=0) == (0, "ValueError: bad")


def test_import_hpctrain_is_light_and_load_imports_torch_when_called():
    """`import hpctrain` (every command's start-up, and Python code that calls `hpctrain.load`)
    imports neither torch nor the API; `hpctrain.load` / `hpctrain.LoadedModel` bring them in."""
    code = ("import json, sys, hpctrain; heavy = lambda: sorted(m for m in ('torch', 'numpy', "
            "'hpctrain.api') if m in sys.modules); before = heavy(); "
            "name = hpctrain.LoadedModel.__name__; print(json.dumps([before, callable(hpctrain.load), "
            "name, heavy()]))")
    r = run_cmd([sys.executable, "-c", code], timeout=120, check=True)
    before, callable_load, name, after = json.loads(r.stdout.strip().splitlines()[-1])
    assert before == [] and callable_load and name == "LoadedModel"
    assert {"torch", "hpctrain.api"} <= set(after)
