"""Training-side data access: the shard reader and the DP-size-independent sampler.

Owns: re-exporting the trainer's data API.  Must never: write datasets (that is data_tools)
or define the on-disk format (data_tools.format is the single definition).
"""
from data_tools.format import DataError
from data_tools.verify import verify_dataset

from .sampler import GlobalSampler, split_for_rank
from .shards import TokenShards

__all__ = ["DataError", "GlobalSampler", "TokenShards", "split_for_rank", "verify_dataset"]
