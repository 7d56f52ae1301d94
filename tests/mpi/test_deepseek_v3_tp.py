"""The DeepSeek-V3 family's tensor-parallel plan under real mpiexec (2 ranks): multi-head latent
attention split over heads (q_b / wq, kv_b column-parallel, wo row-parallel), its low-rank
projections and norms replicated, the one rope key's gradient summed over tp; with and without
sequence parallelism, with and without the query bottleneck. Loss and every gradient equal the
one-rank model's within 1e-5 (without the k_rope gradient sum: k_rope's and tok_emb's gradients off by up to 7.2e-5).
"""
import sys

import pytest

from tests.conftest import ROOT, mpirun

pytestmark = pytest.mark.mpi


def test_tp2_gradients_equal_one_rank():
    cases = ["sp", "no_sp", "no_q_lora_tied"]
    r = mpirun(2, [ROOT / "tests/mpi/scripts/deepseek_v3_tp_probe.py", *cases], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in r.stdout.strip().splitlines()}
    assert sorted(lines) == sorted(cases)
    for name, (loss_diff, grad_diff, bad) in lines.items():
        assert float(loss_diff) < 1e-5 and float(grad_diff) < 1e-5 and bad == "-", (name, lines[name])
