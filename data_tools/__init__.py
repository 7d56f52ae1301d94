"""hpctrain data tools: build, verify and inspect tokenized HDF5 shard datasets.

Owns: the offline side of the data pipeline (``python -m data_tools shard|verify|inspect``).
The shard format lives in ``data_tools.format`` and is shared with the trainer's reader
(``hpctrain.data``).  Must never: import torch or anything from hpctrain's training stack.
The names below load on first use (PEP 562): every hpctrain command imports data_tools.logs, and
must not pay ~0.3 s for numpy and h5py through this package when it reads no shard.
"""
__all__ = ["FORMAT_VERSION", "DataError", "read_manifest", "verify_dataset", "shard_dataset"]
_FORMAT_NAMES = ("FORMAT_VERSION", "DataError", "read_manifest")


def __getattr__(name: str):
    if name in _FORMAT_NAMES:
        from . import format as format_module

        return getattr(format_module, name)
    if name == "verify_dataset":
        from .verify import verify_dataset

        return verify_dataset
    raise AttributeError(f"module 'data_tools' has no attribute {name!r}")


def shard_dataset(*args, **kwargs):
    """See data_tools.shard.shard_dataset (imported lazily: it pulls in tokenizers)."""
    from .shard import shard_dataset as impl

    return impl(*args, **kwargs)
