"""Wire formats and averaging for DiLoCo pseudo-gradients; the fragment schedule."""
import json
import sys

import pytest
import torch

from hpctrain.plan.wire import bytes_sent, wire_layout
from hpctrain.sync.compress import Codec, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from hpctrain.sync.diloco import split_fragments
from tests.conftest import ROOT, mpirun
from tests.shared_dirs import shared_dir


@pytest.mark.parametrize("block", [1, 16, 256])
def test_int8_roundtrip_error_is_at_most_half_a_step(block):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 4096)
    q, scale = quantize_int8(x, block)
    assert q.dtype == torch.int8 and scale.numel() == 4096 // block
    err = (dequantize_int8(q, scale, block) - x).abs().view(-1, block)
    bound = (x.abs().view(-1, block).amax(1) / 127 / 2)[:, None]
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    assert err.max() > 0  # it is lossy: the test would notice a silent fp32 path


def test_int8_zero_block_and_extremes():
    x = torch.zeros(8)
    q, s = quantize_int8(x, 4)
    assert (dequantize_int8(q, s, 4) == 0).all()
    x = torch.tensor([1.0, -1.0, 0.5, 0.0])
    q, s = quantize_int8(x, 4)
    assert q.tolist() == [127, -127, 64, 0]


@pytest.mark.parametrize("block", [2, 16, 256])
def test_int4_roundtrip_error_is_at_most_half_a_step_and_two_codes_per_byte(block):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 1, 4096)
    packed, scale = quantize_int4(x, block)
    assert packed.dtype == torch.uint8 and packed.numel() == 2048 and scale.numel() == 4096 // block
    err = (dequantize_int4(packed, scale, block) - x).abs().view(-1, block)
    bound = (x.abs().view(-1, block).amax(1) / 7 / 2)[:, None]
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    assert err.max() > bound.max() / 10  # 4-bit coarse: an int8 path would be ~18x tighter


def test_int4_codes_and_packing():
    x = torch.tensor([1.0, -1.0, 0.3, 0.0, -0.25, 0.75])
    packed, s = quantize_int4(x, 6)
    assert abs(s.item() - 1 / 7) < 1e-7
    assert packed.tolist() == [15 | (1 << 4), 10 | (8 << 4), 6 | (13 << 4)]  # code + 8, low first
    assert (dequantize_int4(*quantize_int4(torch.zeros(8), 4), 4) == 0).all()


def test_int4_layout_and_wire_bytes():
    assert wire_layout(1001, 1, "int4", 0) == (1002, 1002)  # one scale per chunk: block made even
    assert wire_layout(1001, 1, "int4", 7) == (1008, 8)
    chunk, blk = wire_layout(123_457, 8, "int4", 256)
    parts = Codec("int4", chunk, blk).encode(torch.randn(chunk))
    assert [t.numel() for t in parts] == [chunk // 2, chunk // blk * 4]  # N/2 + fp32 scales
    assert bytes_sent(123_457, 8, "int4", 256) == 2 * 7 * (chunk // 2 + chunk // blk * 4)
    n = 1_000_000
    assert bytes_sent(n, 4, "int4", 256) < bytes_sent(n, 4, "int8", 256) * 0.52
    assert bytes_sent(n, 4, "int4", 256) < bytes_sent(n, 4, "none") / 7.5


def test_bytes_sent_ratios():
    n = 1_000_000
    assert bytes_sent(n, 1, "none") == 0
    assert bytes_sent(n, 2, "none") == 4 * n  # ring all-reduce: 2 (p-1)/p x 4 bytes
    assert bytes_sent(n, 2, "bf16") == 2 * n
    chunk = 500_224  # n / 2 rounded up to whole 256-element blocks
    assert bytes_sent(n, 2, "int8", 256) == 2 * (chunk + chunk // 256 * 4)  # codes + fp32 scales
    assert bytes_sent(n, 4, "int8", 0) < bytes_sent(n, 4, "none") / 3.9


def test_split_fragments_balanced_and_contiguous():
    assert split_fragments([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([5], 3) == [[0]]
    groups = split_fragments([3, 7, 2, 9, 4, 4, 1, 8], 3)
    assert [i for g in groups for i in g] == list(range(8))


@pytest.fixture(scope="module")
def probe_ranks(tmp_path_factory) -> list[dict]:
    """tests/mpi/scripts/compress_probe.py on 3 ranks: each rank's input and results, probed once
    per session (tests/shared_dirs.py: xdist splits the tests that read them between its workers)."""
    out = shared_dir(tmp_path_factory, "compress_probe", lambda out: mpirun(
        3, [ROOT / "tests/mpi/scripts/compress_probe.py", out], check=True, timeout=120))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.mpi
def test_average_bounds_and_identical_results_on_three_ranks(probe_ranks):
    ranks = probe_ranks
    xs = torch.tensor([r["x"] for r in ranks])
    exact = xs.mean(0)
    for key in ("none/0", "bf16/0", "int8/64", "int8/0", "int4/64", "int4/0"):
        results = [torch.tensor(r[key]) for r in ranks]
        assert all(torch.equal(results[0], y) for y in results[1:]), key  # replicas stay identical
        err = (results[0] - exact).abs()
        if key == "none/0":
            assert err.max() < 1e-7
        elif key == "bf16/0":
            assert (err <= exact.abs() * 2 ** -8 + xs.abs().max(0).values * 2 ** -8).all()
        else:  # two quantization stages: mean of the inputs' half-steps + the average's half-step
            kind, block = key.split("/")
            levels = 127 if kind == "int8" else 7
            # 0 = one scale per rank's chunk (ceil(3001/3) = 1001; int4: made even, 1002)
            block = int(block) or (1001 if kind == "int8" else 1002)
            n = exact.numel()
            pad = (-n) % block

            def half_steps(v):
                v = torch.cat([v, torch.zeros(pad)]).view(-1, block)
                return (v.abs().amax(1, keepdim=True) / levels / 2).expand_as(v).reshape(-1)[:n]
            bound = torch.stack([half_steps(x) for x in xs]).mean(0) + half_steps(exact)
            assert (err <= bound * 1.001 + 1e-9).all(), key
            assert err.max() > 0


@pytest.mark.mpi
def test_int4_error_feedback_keeps_the_sum_of_averages_on_the_fp32_one(probe_ranks):
    """20 rounds on 3 ranks: with error feedback the int4 averages add up to the fp32 ones less
    exactly what the residuals still hold (mean of the ranks' e_sent + the owners' e_owned), each
    under half a step; without it the rounds' errors pile up."""
    sums = {k: torch.tensor(probe_ranks[0]["sums"][k]) for k in ("none", "int4", "int4_ef")}
    for r in probe_ranks[1:]:  # every replica got the same averages
        assert all(torch.equal(sums[k], torch.tensor(r["sums"][k])) for k in ("int4", "int4_ef"))
    e_sent = torch.tensor([r["e_sent"] for r in probe_ranks])
    e_owned = torch.tensor([r["e_owned"] for r in probe_ranks])
    assert ((e_owned != 0).sum(0) <= 1).all()  # each element's residual kept by its chunk's owner
    held = e_sent.mean(0) + e_owned.sum(0)
    assert torch.allclose(sums["int4_ef"], sums["none"] - held, rtol=0, atol=1e-8)  # measured 2e-9
    half_step = 6e-3 / 14  # a block's absmax (inputs: sigma 1e-3) < 6 sigma; int4 step: absmax / 7
    assert 0 < e_sent.abs().max() <= half_step and 0 < e_owned.abs().max() <= half_step
    err_ef = (sums["int4_ef"] - sums["none"]).abs().mean()
    err_plain = (sums["int4"] - sums["none"]).abs().mean()
    assert err_ef < 0.5 * err_plain, (err_ef, err_plain)  # measured 7.0e-5 vs 3.1e-4


@pytest.mark.mpi
def test_eager_overlap_starts_average_to_the_anchor_and_offsets_shrink(tmp_path):
    """Overlapped DiLoCo: the replicas' eager start points average exactly to the anchor that the
    late average produces, and a replica's offset from it shrinks every round even when each round
    walks the whole offset back (an estimate from the plain own delta would grow it 1.33x)."""
    mpirun(2, [ROOT / "tests/mpi/scripts/diloco_probe.py", tmp_path, 8], check=True, timeout=120)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    spread = []
    for k in range(1, 8):  # start of round k+1 was estimated at the end of round k
        starts = torch.tensor([log[k]["start"] for log in logs])
        anchor = torch.tensor(logs[0][k]["anchor"])  # after round k's average landed
        assert torch.equal(anchor, torch.tensor(logs[1][k]["anchor"]))
        assert torch.allclose(starts.mean(0), anchor, atol=1e-6), k
        spread.append((starts[0] - starts[1]).norm().item())
    assert spread[0] > 1.0  # round 1's own moves put the replicas apart
    for k in range(1, 7):
        assert spread[k] <= 0.7 * spread[k - 1], (k, spread)


@pytest.mark.mpi
def test_compressed_pulls_keep_each_replica_within_one_quantization_step(tmp_path):
    """async_diloco's pulls (inbox.pull, 2 replicas + 2 servers, 12 arrivals): after every pull a
    replica's weights are bit-identical to the servers' view of them and within half a step of
    theta (per block of the change pulled: error feedback, no drift), and a pull moves the encoded
    slice (+16 header bytes per server), not 4 bytes per element. int8-int4: int8 pushes, int4
    pulls (sync.pull_compression): the bound and the bytes are int4's. int4-int4-ef: error
    feedback on the pushes (sync.error_feedback) keeps the same pull bounds, and the residual is
    carried: the sum the servers applied is the replica's sum of pseudo-gradients minus its
    residual (to fp32 rounding), the residual within half a step of the last push's block, while
    without it the roundings add up."""
    mpirun(4, [ROOT / "tests/mpi/scripts/pull_probe.py", tmp_path], check=True, timeout=300)
    for kind in ("int8", "int4", "int8-int4", "int4-int4-ef"):
        servers = [json.loads((tmp_path / f"server{r}_{kind}.json").read_text()) for r in (2, 3)]
        for s in servers:
            assert s["identical"], kind
            assert len(s["ratios"]) == 24 and max(s["ratios"]) <= 1.0 + 1e-3, (kind, max(s["ratios"]))
            assert max(s["ratios"]) > 0.3, kind  # lossy: an fp32 path would give 0
        slots = [s["pull_bytes"][0] for s in servers]
        moved = json.loads((tmp_path / f"replica0_{kind}.json").read_text())["moved"]
        assert moved == [sum(slots) + 32] * 12, kind
        codes = 1536 if kind == "int8" else 768  # 1500 elements, padded to 64-element blocks
        assert slots == [codes + 24 * 4, codes + 24 * 4]
        assert [s["slot_bytes"][0] for s in servers] == [1536 + 24 * 4] * 2 if kind[:4] != "int4" else slots
    ef = [json.loads((tmp_path / f"server{r}_int4-int4-ef.json").read_text()) for r in (2, 3)]
    plain = [json.loads((tmp_path / f"server{r}_int4.json").read_text()) for r in (2, 3)]
    ratios = json.loads((tmp_path / "replica0_int4-int4-ef.json").read_text())["push_ratios"]
    assert len(ratios) == 6 and 0.5 < max(ratios) <= 1.0 + 1e-3, ratios  # one push's rounding at most
    for e, p in zip(ef, plain):
        assert e["carried"] < 1e-5 < 0.01 < e["drift"], e  # sum applied = sum of g - the residual
        assert p["carried"] == p["drift"] > 1.5 * e["drift"], (p, e)  # without it: every push's error
