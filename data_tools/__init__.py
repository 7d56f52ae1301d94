"""hpctrain data tools: build, verify and inspect tokenized HDF5 shard datasets.

Owns: the offline side of the data pipeline (``python -m data_tools shard|verify|inspect``).
The shard format lives in ``data_tools.format`` and is shared with the trainer's reader
(``hpctrain.data``).  Must never: import torch or anything from hpctrain's training stack.
"""
from .format import FORMAT_VERSION, DataError, read_manifest
from .verify import verify_dataset

__all__ = ["FORMAT_VERSION", "DataError", "read_manifest", "verify_dataset", "shard_dataset"]


def shard_dataset(*args, **kwargs):
    """See data_tools.shard.shard_dataset (imported lazily: it pulls in tokenizers)."""
    from .shard import shard_dataset as impl

    return impl(*args, **kwargs)
