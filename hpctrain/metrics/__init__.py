"""Metrics: JSONL log (rank 0), throughput and MFU."""
from hpctrain.metrics.jsonl import MetricsLog
from hpctrain.metrics.mfu import measure_peak_flops

__all__ = ["MetricsLog", "measure_peak_flops"]
