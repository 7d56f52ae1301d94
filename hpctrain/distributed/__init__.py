"""Launch layer: MPI -> torch.distributed bootstrap, abort-on-error, teardown."""
from hpctrain.distributed.abort import run_or_abort
from hpctrain.distributed.bootstrap import DistContext, choose_backend, init_distributed, teardown

__all__ = ["DistContext", "choose_backend", "init_distributed", "run_or_abort", "teardown"]
