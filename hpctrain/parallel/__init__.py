"""Parallelism applied to an unmodified model from outside: `parallelize(model, mesh, cfg)` returns a
`ParallelModel` that runs forward/backward, clipping, evaluation and checkpoint state per layout."""
from hpctrain.parallel.parallelize import ParallelModel, grad_sync_context, lm_loss, parallelize

__all__ = ["ParallelModel", "grad_sync_context", "lm_loss", "parallelize"]
