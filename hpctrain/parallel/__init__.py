"""Parallelism applied to an unmodified model from outside, in two steps as in torchtitan:
`parallelize(model, mesh, cfg)` applies the layout and returns a `Layout` (the modules and process
groups); `build_runner(layout, cfg)` returns the `StepRunner` that runs forward/backward, clipping
and evaluation on it. Its layout-free checkpoint state: hpctrain/train/states.py."""
from hpctrain.parallel.parallelize import Layout, parallelize
from hpctrain.parallel.runner import StepRunner, build_runner, lm_loss

__all__ = ["Layout", "StepRunner", "build_runner", "lm_loss", "parallelize"]
