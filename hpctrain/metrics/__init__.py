"""Metrics: JSONL log (rank 0, plus TensorBoard event files when installed), throughput and MFU."""
from hpctrain.metrics.jsonl import MetricsLog
from hpctrain.metrics.mfu import measure_peak_flops
from hpctrain.metrics.progress import format_eta

__all__ = ["MetricsLog", "format_eta", "measure_peak_flops"]
