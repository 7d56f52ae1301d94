"""Expert parallelism (hpctrain/parallel/expert.py, #34): one MoE layer's 8 experts sharded over 4
ranks (ep=2: the training runs of tests/mpi/test_moe_parallel.py), tokens exchanged with
all-to-all, against the same layer on one rank under deliberately skewed routing: every rank's
outputs equal, its experts' weight gradients within 1e-6 of their largest entry (summed per
source rank since #34's per-source blocks), the router's gradient (summed over ranks) within 1e-5,
and dropless: the rows the experts computed, summed over ranks, are exactly the routed slots
(192 tokens x top-2); every dist collective of the sharded layer (the counts' all-gather) gets
tensors on the rank's device only, as NCCL requires: the probe makes torch's default device "meta"
and refuses any other with NCCL's message (a "cuda:gloo" group, which refuses CPU tensors for real,
cannot run a CPU rank's layer at all: tests/unit/test_gpu_safety.py); and no rank prints a
deprecation warning (#47: torch's FutureWarning for all_gather_into_tensor, once per rank).

parallel.deterministic_experts' recursive-doubling sum with sends that wait for their receive in
each rank's issue order, as NCCL runs them (#49: both ranks of a pair sent first and hung):
finishes, every rank bit-equal to the tree sum (tests/mpi/scripts/recursive_doubling_probe.py).

Host syncs of an ep2 layer on the path a CUDA run takes (#49 defect 4,
tests/mpi/scripts/expert_syncs_probe.py): one per layer in forward (the split sizes' host copy),
none in backward, per-source blocks and one group per expert alike (before: 3 in forward, the
counts made into a tensor from a host list once per source rank)."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT, mpirun

PROBE = ROOT / "tests/mpi/scripts/expert_parallel_probe.py"
DOUBLING = ROOT / "tests/mpi/scripts/recursive_doubling_probe.py"
SYNCS = ROOT / "tests/mpi/scripts/expert_syncs_probe.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ep", [4])  # ep=2: the training runs of test_moe_parallel.py
def test_sharded_experts_equal_one_rank(ep):
    r = mpirun(ep, [PROBE, "8"], timeout=240)
    assert "No backend type associated" not in r.stderr, r.stderr[-2000:]  # a host tensor reached one
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == ep, r.stdout
    for ln in lines:
        fields = dict(zip(ln[2::2], ln[3::2]))
        assert float(fields["out"]) <= 1e-6 and float(fields["experts"]) <= 1e-6, ln
        assert float(fields["router"]) <= 1e-5, ln
        assert int(fields["computed"]) == int(fields["routed"]) == 192 * 2, ln
        assert int(fields["max_load"]) > 1.5 * 192 * 2 / 8, ln  # really unbalanced
        assert int(fields["collectives"]) >= 1, ln  # the counts' exchange ran under the device check
    # #47: the counts' all-gather used torch's deprecated name: a FutureWarning on every rank
    assert "FutureWarning" not in r.stderr and "deprecated" not in r.stderr, r.stderr[-2000:]


@pytest.mark.mpi
def test_recursive_doubling_sum_finishes_when_sends_wait_for_their_receive():
    """4 ranks (partners at distance 1, then 2); a send that waited forever would end its rank
    after the group's 10 s timeout with Gloo's "Timed out" error (before #49's fix: every rank)."""
    r = mpirun(4, [DOUBLING, "10"], timeout=120)
    assert r.returncode == 0 and "Timed out" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    lines = sorted(ln for ln in r.stdout.splitlines() if ln.startswith("rank "))
    assert [ln.split()[:4] for ln in lines] == [["rank", f"{i}:", "equal", "1"] for i in range(4)], lines
    assert max(float(ln.split()[5]) for ln in lines) < 5, lines  # no rank waited for a timeout


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["per_source", "all_sources"])
def test_ep2_layer_syncs_once_in_forward_and_never_in_backward(mode):
    r = mpirun(2, [SYNCS, mode], timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = sorted(ln for ln in r.stdout.splitlines() if ln.startswith("rank "))
    assert lines == [f"rank {i}: forward 1 {{'to cpu': 1}} backward 0 rows 256" for i in range(2)], lines
