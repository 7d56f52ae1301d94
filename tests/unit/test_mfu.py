"""MFU is honest: never above 100% under a loaded peak measurement, the CPU peak is measured once
per machine and reused from the cache, GPUs use their datasheet peak, and the layout does not
change the MFU of equal tokens/s."""
from __future__ import annotations

import json

import pytest

from hpctrain.metrics.mfu import MfuMeter, core_share, job_peak_flops, model_flops_utilization
from hpctrain.metrics.peak import PeakCache, cpu_peak, gpu_datasheet_peak

FLOPS_PER_TOKEN = 82.7e6  # bench/mfu.py's model


class CountingMeasure:
    def __init__(self, flops: float):
        self.flops, self.calls = flops, 0

    def __call__(self, device, dtype) -> float:
        self.calls += 1
        return self.flops


def test_loaded_measurement_never_gives_mfu_above_one(tmp_path):
    cache = PeakCache(tmp_path / "peak_flops.json")
    loaded = CountingMeasure(1e9)  # a peak measured while the machine was busy: 1 GFLOP/s
    peak = cpu_peak("fp32", 2, cache, loaded)
    raised = []
    meter = MfuMeter(FLOPS_PER_TOKEN, peak.flops, on_raise=lambda ratio: raised.append(ratio))
    assert meter(6.0) == pytest.approx(FLOPS_PER_TOKEN * 6.0 / 1e9)  # 0.496: below the peak
    assert meter(24.0) == 1.0  # 1.98 GFLOP/s achieved > 1 GFLOP/s: the peak is raised, not 198%
    assert meter.peak == pytest.approx(FLOPS_PER_TOKEN * 24.0)
    assert raised == [pytest.approx(FLOPS_PER_TOKEN * 24.0 / 1e9)]
    assert meter(12.0) == pytest.approx(0.5)  # later steps against the raised peak
    cache.raise_to(peak.cache_key, peak.flops * raised[0])  # what job_meter's rank 0 does
    again = cpu_peak("fp32", 2, cache, loaded)
    assert loaded.calls == 1 and again.flops == pytest.approx(FLOPS_PER_TOKEN * 24.0)
    cache.raise_to(peak.cache_key, 1.0)  # never lowered
    assert cache.get(peak.cache_key) == pytest.approx(FLOPS_PER_TOKEN * 24.0)


def test_unknown_peak_gives_no_mfu():
    assert MfuMeter(FLOPS_PER_TOKEN, None)(1000.0) is None


def test_cpu_peak_is_measured_once_and_reused(tmp_path):
    path = tmp_path / "hpctrain" / "peak_flops.json"
    measure = CountingMeasure(3.5e11)
    first = cpu_peak("bf16", 4, PeakCache(path), measure)
    second = cpu_peak("bf16", 4, PeakCache(path), measure)
    assert measure.calls == 1 and first.flops == second.flops == 3.5e11
    assert "measured now" in first.source and "cached in" in second.source and str(path) in second.source
    stored = json.loads(path.read_text())
    assert list(stored) == [first.cache_key] and "threads=4" in first.cache_key and "bf16" in first.cache_key
    assert [p.name for p in path.parent.iterdir()] == ["peak_flops.json"]  # no temporary left
    cpu_peak("bf16", 2, PeakCache(path), measure)  # another thread count: its own entry
    cpu_peak("fp32", 4, PeakCache(path), measure)  # another dtype: its own entry
    assert measure.calls == 3 and len(json.loads(path.read_text())) == 3


def test_unwritable_cache_still_gives_a_peak(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    measure = CountingMeasure(2e10)
    peak = cpu_peak("fp32", 1, PeakCache(blocker / "hpctrain" / "peak_flops.json"), measure)
    assert peak.flops == 2e10 and "not cached" in peak.source


def test_corrupt_cache_is_measured_again(tmp_path):
    path = tmp_path / "peak_flops.json"
    path.write_text("{half a fi")
    measure = CountingMeasure(2e10)
    assert cpu_peak("fp32", 1, PeakCache(path), measure).flops == 2e10 and measure.calls == 1
    assert json.loads(path.read_text())


@pytest.mark.parametrize("name, dtype, table, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", "H100 SXM", 989.5),
    ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "fp16", "H100 NVL", 835.0),
    ("NVIDIA H200", "tf32", "H200 SXM", 494.7),
    ("NVIDIA GH200 480GB", "bf16", "GH200", 989.5),
    ("NVIDIA A100-SXM4-40GB", "bf16", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "tf32", "A100", 156.0),
    ("NVIDIA L40S", "bf16", "L40S", 362.1),
    ("NVIDIA L4", "fp16", "L4", 121.0),
    ("NVIDIA A10", "fp32", "A10", 31.2),
    ("Tesla V100-SXM2-32GB", "fp16", "V100 SXM2", 125.0),
    ("Tesla V100-PCIE-16GB", "fp32", "V100 PCIe", 14.0),
    ("Tesla T4", "fp16", "T4", 65.0),
    ("AMD Instinct MI250X", "bf16", "MI250X (one die)", 191.5),
    ("AMD Instinct MI300X", "bf16", "MI300X", 1307.4),
])
def test_gpu_datasheet_lookup_by_name(name, dtype, table, tflops):
    found, flops = gpu_datasheet_peak(name, dtype)
    assert found == table and flops == pytest.approx(tflops * 1e12)


def test_gpu_without_units_or_unknown_has_no_peak():
    assert gpu_datasheet_peak("Tesla T4", "bf16") == ("T4", None)  # no bf16 tensor units
    assert gpu_datasheet_peak("NVIDIA A10G", "bf16") is None  # not the A10
    assert gpu_datasheet_peak("NVIDIA GeForce GTX 1080", "fp32") is None


@pytest.mark.parametrize("layout", [(1, 4, 1), (1, 2, 2), (2, 2, 1), (1, 1, 4), (4, 1, 1)])
def test_equal_tokens_per_s_give_equal_mfu_in_every_layout(layout):
    """4 ranks of 2 threads on an 8-core node, 0.27 TFLOP/s each: DDP/FSDP (dp 4), TP, PP."""
    pp, dp, tp = layout
    peak = job_peak_flops(0.27e12, pp, dp, tp, local_size=4, threads=2, cores=8)
    assert peak == pytest.approx(4 * 0.27e12)
    assert model_flops_utilization(FLOPS_PER_TOKEN, 5313.0, peak) == pytest.approx(
        FLOPS_PER_TOKEN * 5313.0 / (4 * 0.27e12))


def test_mfu_is_proportional_to_tokens_per_s_across_layouts():
    """The issue's runs: FSDP at 5,313 tokens/s and TP at 1,376 on the same ranks: MFU in the
    ratio of tokens/s (3.86), not 52.8% vs 25.0%."""
    fsdp = model_flops_utilization(FLOPS_PER_TOKEN, 5313.0, job_peak_flops(1e12, 1, 2, 1, 2, 1, 2))
    tp = model_flops_utilization(FLOPS_PER_TOKEN, 1376.0, job_peak_flops(1e12, 1, 1, 2, 2, 1, 2))
    assert fsdp / tp == pytest.approx(5313.0 / 1376.0)


def test_ranks_sharing_cores_count_their_share():
    assert core_share(local_size=4, threads=1, cores=2) == 0.5  # oversubscribed: half a core each
    assert core_share(local_size=2, threads=1, cores=2) == 1.0
    assert job_peak_flops(1e10, 1, 4, 1, local_size=4, threads=1, cores=2) == pytest.approx(2e10)


def test_job_meter_measures_once_per_machine_and_says_so(tmp_path, monkeypatch):
    """The trainer's entry point on a real one-rank MPI communicator: the first start measures
    (once, on the node's first rank) and caches, the next reads the cache; the line names both."""
    from types import SimpleNamespace

    import torch
    from mpi4py import MPI

    from hpctrain.metrics import peak as peak_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measure = CountingMeasure(5e10)
    monkeypatch.setattr(peak_mod, "measure_peak_flops", lambda device, dtype, **kw: measure(device, dtype))
    ctx = SimpleNamespace(device=torch.device("cpu"), threads=1, local_rank=0, local_size=1, rank=0,
                          world_size=1, comm=MPI.COMM_SELF, node_comm=MPI.COMM_SELF)
    first, line1 = peak_mod.job_meter(ctx, "fp32", FLOPS_PER_TOKEN)
    second, line2 = peak_mod.job_meter(ctx, "fp32", FLOPS_PER_TOKEN)
    assert measure.calls == 1 and first.peak == second.peak == 5e10
    assert "measured now" in line1 and "cached in" in line2 and str(tmp_path) in line2
    assert second(1e9) == 1.0  # 82.7 TFLOP/s achieved > 50 GFLOP/s: the cache is raised to it
    stored = json.loads((tmp_path / "hpctrain" / "peak_flops.json").read_text())
    assert list(stored.values()) == [pytest.approx(FLOPS_PER_TOKEN * 1e9)]
