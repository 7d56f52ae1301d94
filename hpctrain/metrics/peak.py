"""The peak FLOP/s MFU divides by: one rank's device, looked up or measured once per machine.

GPUs: the datasheet's dense (no-sparsity) tensor-core peak of the detected device at the training
precision (GPU_DATASHEET; fp32 counts as tf32 where torch lets matmuls use tf32). A GPU or a
precision not in the table has no peak: MFU is unknown, said once at start-up.

CPUs: no datasheet peak is reachable, so the peak is measured (an n x n matmul at the training
precision with the rank's thread count, the best of several trials, hpctrain/metrics/mfu.py) ONCE
per machine and kept in a per-user cache file ($XDG_CACHE_HOME/hpctrain/peak_flops.json, else
~/.cache/hpctrain/), keyed by CPU model, thread count and dtype, written atomically. A measurement
taken while other work loaded the machine is too low; when a run later achieves more than it, the
peak is raised to what was achieved (MFU 100%, never above) and the cache keeps the raised value.

Owns: the datasheet table, the cache file and its keys. The MFU formula is in mfu.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hpctrain.metrics.mfu import MfuMeter, core_share, measure_peak_flops

TERA = 1e12
# (pattern on torch.cuda.get_device_name, name, {dtype: dense TFLOP/s}); the first match wins, so
# the specific names come first. AMD MI250X / MI250 show each of their two dies as one device: the
# numbers are per die (half the card's).
GPU_DATASHEET: list[tuple[str, str, dict[str, float]]] = [
    (r"H200 NVL", "H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200", "H200 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    (r"GH200", "GH200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    (r"H100 NVL", "H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H100", "H100 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"L40\b", "L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA40\b", "A40", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100S", "V100S", {"fp16": 130.0, "fp32": 16.4}),
    (r"V100.*PCIE", "V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", "V100 SXM2", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", "T4", {"fp16": 65.0, "fp32": 8.1}),
    (r"MI300X", "MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"MI300A", "MI300A", {"bf16": 980.6, "fp16": 980.6, "tf32": 490.3, "fp32": 122.6}),
    (r"MI250X", "MI250X (one die)", {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9}),
    (r"MI250", "MI250 (one die)", {"bf16": 181.0, "fp16": 181.0, "fp32": 45.3}),
    (r"MI210", "MI210", {"bf16": 181.0, "fp16": 181.0, "fp32": 45.3}),
]


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak FLOP/s (None: unknown) and where it comes from, for the start-up line."""
    flops: float | None
    source: str
    cache_key: str | None = None  # set where the peak is a cached CPU measurement


def gpu_datasheet_peak(device_name: str, dtype: str) -> tuple[str, float | None] | None:
    """(table name, FLOP/s or None where the GPU has no such units) of `device_name`; None: not in
    the table."""
    for pattern, name, peaks in GPU_DATASHEET:
        if re.search(pattern, device_name, re.IGNORECASE):
            tflops = peaks.get(dtype)
            return name, None if tflops is None else tflops * TERA
    return None


def gpu_peak(device: torch.device, precision: str) -> RankPeak:
    name = torch.cuda.get_device_name(device)
    precision = "bf16" if precision == "fp8" else precision  # fp8: against bf16's peak (torchtitan's)
    dtype = precision if precision in ("bf16", "fp16") else (
        "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
    found = gpu_datasheet_peak(name, dtype)
    if found is None:
        return RankPeak(None, f"GPU '{name}' is not in the datasheet table (hpctrain/metrics/peak.py)")
    table_name, flops = found
    if flops is None:
        return RankPeak(None, f"{table_name} has no {dtype} tensor units in the datasheet table")
    return RankPeak(flops, f"{table_name} datasheet {dtype} dense")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpctrain" / "peak_flops.json"


class PeakCache:
    """{key: FLOP/s} in one JSON file; every write replaces the file atomically (a reader never
    sees half a file). An unreadable file is an empty cache; an unwritable one is not kept."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_file()

    def read(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
            return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def get(self, key: str) -> float | None:
        return self.read().get(key)

    def put(self, key: str, flops: float) -> bool:
        """Store `flops` under `key`; False where the file cannot be written."""
        data, tmp = {**self.read(), key: flops}, None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".peak_flops.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            return True
        except OSError:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False

    def raise_to(self, key: str, flops: float) -> None:
        """A loaded measurement: keep the higher rate a run achieved."""
        if flops > (self.get(key) or 0.0):
            self.put(key, flops)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_peak(precision: str, threads: int, cache: PeakCache | None = None,
             measure: Callable[[torch.device, torch.dtype], float] | None = None) -> RankPeak:
    """The cached peak of this CPU model at `threads` threads and `precision`, measured (and cached)
    the first time."""
    cache = cache or PeakCache()
    dtype = precision if precision in DTYPES else "fp32"
    key = f"{cpu_model()} | threads={threads} | {dtype}"
    flops = cache.get(key)
    how = f"cached in {cache.path}"
    if flops is None:
        measure = measure or (lambda dev, dt: measure_peak_flops(dev, dt, trials=5, budget_s=0.2))
        flops = measure(torch.device("cpu"), DTYPES[dtype])
        how = f"measured now, cached in {cache.path}" if cache.put(key, flops) else "measured now, not cached"
    return RankPeak(flops, f"CPU {dtype} matmul peak at {threads} thread(s), {how}", key)


def rank_peak(device: torch.device, precision: str, threads: int) -> RankPeak:
    """This rank's peak: the GPU's datasheet, or the CPU's measured-once peak."""
    if device.type == "cuda":
        return gpu_peak(device, precision)
    return cpu_peak(precision, threads)


def _wait_quietly(comm) -> None:
    """A barrier that sleeps instead of spinning (MPI spins in blocking calls: the node's other
    ranks would load the cores its leader measures)."""
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(0.005)


def job_meter(ctx, precision: str, flops_per_token: float,
              ranks_per_record: int | None = None) -> tuple[MfuMeter, str]:
    """Collective: the job's MfuMeter and the start-up line saying what MFU is measured against.
    GPU ranks look up their own device; on CPUs each node's first rank gets the peak (measuring
    it, the first time, while the node's other ranks sleep) and tells the others.
    `ranks_per_record`: where a metrics record counts the tokens of fewer ranks than the job's
    (async_diloco: one replica's), the peak is that many ranks' (of the mean rank)."""
    if ctx.device.type == "cuda":
        mine, share = rank_peak(ctx.device, precision, ctx.threads), 1.0
    else:
        mine = rank_peak(ctx.device, precision, ctx.threads) if ctx.local_rank == 0 else None
        _wait_quietly(ctx.node_comm)
        mine = ctx.node_comm.bcast(mine, root=0)
        share = core_share(ctx.local_size, ctx.threads, os.cpu_count() or 1)
    parts = ctx.comm.allgather(None if mine.flops is None else mine.flops * share)
    if any(p is None for p in parts):
        return MfuMeter(flops_per_token, None), f"mfu: unknown ({mine.source})"
    on_raise = None
    if ctx.rank == 0 and mine.cache_key is not None:
        def on_raise(ratio: float, key=mine.cache_key, flops=mine.flops) -> None:
            PeakCache().raise_to(key, flops * ratio)
    shared = f" x {share:.2f} (ranks share the cores)" if share < 1 else ""
    ranks = ranks_per_record or ctx.world_size
    peak = sum(parts) * ranks / ctx.world_size
    whose = "" if ranks == ctx.world_size else " (one replica's, whose tokens a record counts)"
    line = (f"mfu: against {peak / TERA:.4g} TFLOP/s = {ranks} rank(s){whose} x "
            f"{mine.flops / TERA:.4g} TFLOP/s{shared} ({mine.source}); never above 100%")
    return MfuMeter(flops_per_token, peak, on_raise), line
