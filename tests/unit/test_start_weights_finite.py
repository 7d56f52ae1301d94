"""The weights a run starts from (init.from's, a resumed checkpoint's) are checked for NaN / inf
once, before step 1 (#47): `first_nonfinite` names the first bad tensor, agreed by every rank (one
MIN all-reduce; the names gathered only when one is bad). The `train` rows naming the tensor and
its file or checkpoint are in test_bad_input_table.py."""
from __future__ import annotations

import torch

from hpctrain.train.bad_steps import first_nonfinite
from tests.conftest import mpirun


def test_the_first_bad_tensor_is_named_a_tied_one_once():
    tied = torch.ones(3)
    named = {"a": torch.ones(2, 2), "b.tied": tied, "b.again": tied, "c": torch.ones(4),
             "d": torch.ones(2)}
    assert first_nonfinite(named, torch.device("cpu")) is None
    named["c"][2] = float("inf")
    named["d"][0] = float("nan")
    assert first_nonfinite(named, torch.device("cpu")) == "c"
    tied[1] = float("nan")
    assert first_nonfinite(named, torch.device("cpu")) == "b.tied"
    assert first_nonfinite({}, torch.device("cpu")) is None


AGREE = r"""
import sys, torch
from hpctrain.distributed import init_distributed, teardown
from hpctrain.train.bad_steps import first_nonfinite
ctx = init_distributed("gloo", timeout_s=60)
named = {f"rank{ctx.rank}.w": torch.ones(4), f"rank{ctx.rank}.v": torch.ones(2)}
sys.stdout.write(f"rank {ctx.rank} clean: {first_nonfinite(named, ctx.device)}\n")  # one write a line
if ctx.rank == 1:
    named["rank1.v"][1] = float("nan")
sys.stdout.write(f"rank {ctx.rank} poisoned: {first_nonfinite(named, ctx.device)}\n")
teardown()
"""


def test_every_rank_names_the_tensor_another_rank_holds():
    r = mpirun(2, ["-c", AGREE], timeout=120)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"rank {rank} clean: None" in r.stdout, r.stdout
        assert f"rank {rank} poisoned: rank1.v" in r.stdout, r.stdout
