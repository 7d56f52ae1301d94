"""Parallelism applied to an unmodified model from outside: `parallelize(model, mesh, cfg)`."""
from hpctrain.parallel.parallelize import grad_sync_context, parallelize

__all__ = ["grad_sync_context", "parallelize"]
