"""Metrics: JSONL log (rank 0, plus TensorBoard event files when installed), throughput and MFU.

measure_peak_flops (mfu.py, torch) loads on first use (PEP 562): `hpctrain plot` reads JSON and
draws, and must not pay ~1.7 s of importing torch for it."""
from hpctrain.metrics.jsonl import MetricsLog
from hpctrain.metrics.progress import format_eta

__all__ = ["MetricsLog", "format_eta", "measure_peak_flops"]


def __getattr__(name: str):
    if name == "measure_peak_flops":
        from hpctrain.metrics.mfu import measure_peak_flops

        return measure_peak_flops
    raise AttributeError(f"module 'hpctrain.metrics' has no attribute {name!r}")
