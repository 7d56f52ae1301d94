"""Launch layer: MPI -> torch.distributed bootstrap, abort-on-error, teardown.

The bootstrap names load on first use (PEP 562): `slurm`, `preempt` and the sbatch templates'
helper (`sbatch_helper`) must not pay for importing torch in a batch shell."""
from hpctrain.distributed.abort import run_or_abort

_BOOTSTRAP = ("DistContext", "choose_backend", "init_distributed", "teardown")
__all__ = ["DistContext", "choose_backend", "init_distributed", "run_or_abort", "teardown"]


def __getattr__(name: str):
    if name in _BOOTSTRAP:
        from hpctrain.distributed import bootstrap

        return getattr(bootstrap, name)
    raise AttributeError(f"module 'hpctrain.distributed' has no attribute {name!r}")
