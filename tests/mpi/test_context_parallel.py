"""Context-parallel attention (hpctrain/parallel/context_parallel.py, #51) under a real mpiexec
(gloo), cp = 2 and 4, one launch each running every case
(tests/mpi/scripts/context_parallel_probe.py): each rank's zig-zag part of the output and of the
q, k, v gradients equals full-sequence SDPA on one rank within 1e-5 (fp32), for ring and Ulysses
attention, causal and with packed document ids, 4/4 and 8/4 (grouped-query) heads, and a v width
(12; the ring also 6) other than q/k's (8) as multi-head latent attention has (on the CPU the
ring's blocks run torch's fused flash kernel); the ring computes exactly the chunk pairs where some
query sees some key (all 2cp(2cp+1)/2 causal pairs without documents, fewer with them: the others
skipped); and the ring finishes with sends that wait for their receive (NCCL's order, #49; a
deadlock ends after the group's 20 s timeout with Gloo's "Timed out" error). The one-process
arithmetic: tests/unit/test_context_parallel_blocks.py."""
from __future__ import annotations

import pytest

from tests.conftest import ROOT, mpirun

PROBE = ROOT / "tests/mpi/scripts/context_parallel_probe.py"
CASES = [f"{kernel}-{mask}-{heads}" for kernel in ("ring", "ulysses") for mask in ("causal", "docs")
         for heads in ("4/4", "8/4")] + ["ring-docs-v12", "ulysses-docs-v12", "ring-causal-v6",
                                         "ring-waiting-sends"]


def _results(stdout: str) -> dict[tuple[int, str], dict[str, float]]:
    """{(rank, case): {"out": .., "dq": .., "dk": .., "dv": .., "live": .., "of": .., "expected": ..}}"""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("rank "):
            words = line.split()
            found[(int(words[1]), words[3])] = {k: float(v) for k, v in zip(words[4::2], words[5::2])}
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_full_sequence_sdpa(cp):
    r = mpirun(cp, [PROBE, "20"], timeout=300)
    assert r.returncode == 0 and "Timed out" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    found = _results(r.stdout)
    assert sorted(found) == sorted((rank, case) for rank in range(cp) for case in CASES), r.stdout
    causal_pairs = 2 * cp * (2 * cp + 1) // 2
    for (rank, case), f in found.items():
        assert max(f["out"], f["dq"], f["dk"], f["dv"]) <= 1e-5, (rank, case, f)
        assert f["of"] == causal_pairs and f["live"] == f["expected"], (rank, case, f)
        if "causal" in case:
            assert f["live"] == causal_pairs, (rank, case, f)
    if cp == 4:  # chunks of 6 tokens: some pairs share no document, and are skipped
        assert found[(0, "ring-docs-8/4")]["live"] < causal_pairs
