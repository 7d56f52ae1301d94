"""Training-side data access: the shard/blend readers and the DP-size-independent samplers.

Owns: re-exporting the trainer's data API.  Must never: write datasets (that is data_tools)
or define the on-disk format (data_tools.format is the single definition).
"""
from data_tools.format import DataError
from data_tools.verify import verify_dataset

from .blend import BlendShards, make_sampler, open_split
from .mixture import MixtureSampler
from .sampler import GlobalSampler, split_for_rank
from .shards import TokenShards

__all__ = ["BlendShards", "DataError", "GlobalSampler", "MixtureSampler", "TokenShards",
           "make_sampler", "open_split", "split_for_rank", "verify_dataset"]
