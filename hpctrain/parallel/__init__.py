"""Parallelism applied to an unmodified model from outside, in two steps as in torchtitan:
`parallelize(model, mesh, cfg)` applies the layout and returns a `Layout` (the modules and process
groups); `build_runner(layout, cfg)` returns the `StepRunner` that runs forward/backward, clipping
and evaluation on it. `checkpoint_state` / `load_checkpoint_state` give its layout-free state."""
from hpctrain.parallel.parallelize import Layout, parallelize
from hpctrain.parallel.runner import StepRunner, build_runner, lm_loss
from hpctrain.parallel.state import checkpoint_state, load_checkpoint_state

__all__ = ["Layout", "StepRunner", "build_runner", "checkpoint_state", "lm_loss",
           "load_checkpoint_state", "parallelize"]
