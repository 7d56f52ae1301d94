"""The data pipeline's and the checkpoints' bytes and files: sampler, node cache, checkpoints.

Owns the arithmetic of:
- the sampler (data/sampler.py): windows = sum over shards of (shard tokens - 1) // block_size.
  data.shuffle = "global": each rank keeps its epoch's int64 permutation (8 B x windows); building
  one (`rng.permutation` = an int64 arange shuffled, then `.astype(np.int64)` copies it) while the
  old epoch's is still referenced peaks at 24 B x windows. data.shuffle = "block"
  (data/block_order.py): the window offsets and the epoch's shard order (16 B x shards, + 8 B x
  blocks) and the window permutations of two blocks (8 B x a block's windows each); a new
  epoch's shard order peaks at 24 B x shards (old blocks dropped first), a third block's
  permutation while two are held at 16 B x shards + 24 B x a block's windows. With the node
  cache (data/prefetch.py) the node leader's planner thread keeps its own copy of the order:
  the kept bytes once more on that rank.
- the node cache (data/cache.py): the corpus on disk (uint16 tokens up to a 65,536 vocabulary,
  uint32 beyond), the shards a node's ranks touch in the `prefetch` window (a global random order
  draws each sample from any shard; the block order two blocks), and whether the whole corpus
  fits the budget (with the global order it must, or nearly every step re-stages shards).
- checkpoints (checkpoint/manager.py, disk_format.py): DCP writes one `__<rank>_0.distcp` per rank
  (one writer thread; checkpoint.layout = "node": one `__node<k>.distcp` per node, node_layout.py),
  plus `.metadata`, `state_nontensor.json`, `trainer_state.json` and `COMMIT.json`; tensors are fp32 parameters + AdamW m, v = 12 B per parameter (the tied weight
  once); DiLoCo saves the global model and outer momentum plus every replica's local model and
  inner optimizer (sync/diloco.py checkpoint_states); async_diloco the global model, momentum and
  accumulator and each replica's weights, start point, inner optimizer (plan/async_model.py).
It must never compute GPU memory (memory.py) or communication (comm.py).
"""
from __future__ import annotations

import math

from hpctrain.plan import async_model
from hpctrain.plan.layout import Job
from hpctrain.plan.shape import ModelShape

CHECKPOINT_SMALL_FILES = (".metadata", "state_nontensor.json", "trainer_state.json", "COMMIT.json")
# From this many ranks (with several per node) the plan recommends checkpoint.layout = "node": every
# save creates one file per rank in ONE directory, and a parallel filesystem's metadata server
# serializes the creates of a directory (Lustre: one lock per directory; ~ thousands of creates/s
# per MDT shared by every job), so at hundreds of ranks the creates, opens and closes (and the
# loads' opens) cost seconds per save; the node layout divides them by the ranks per node.
NODE_LAYOUT_FROM_RANKS = 256


def n_shards(job: Job) -> int:
    return max(1, math.ceil(job.tokens / job.shard_tokens))


def n_windows(shape: ModelShape, job: Job) -> int:
    """TokenShards.n_samples for a corpus of `job.tokens` in shards of `job.shard_tokens`."""
    full, rest = divmod(int(job.tokens), job.shard_tokens)
    per_full = (job.shard_tokens - 1) // shape.block_size
    return full * per_full + max(0, rest - 1) // shape.block_size


def block_windows(shape: ModelShape, job: Job) -> int:
    """Windows of one block of the "block" order (full shards; the whole corpus at most)."""
    per_shard = (job.shard_tokens - 1) // shape.block_size
    return min(n_windows(shape, job), job.shuffle_block_shards * per_shard)


def sampler_bytes(shape: ModelShape, job: Job) -> dict:
    w = n_windows(shape, job)
    if job.shuffle == "global" or n_shards(job) <= job.shuffle_block_shards:
        kept, peak = 8 * w, 24 * w  # one block = the global permutation
    else:
        shards, block = n_shards(job), block_windows(shape, job)
        blocks = math.ceil(shards / job.shuffle_block_shards)  # + 8 B x blocks of offsets
        kept = 16 * shards + 8 * blocks + 16 * block
        peak = max(24 * (shards + blocks), 16 * shards + 8 * blocks + 24 * block)
    return {"windows": w, "per rank (kept)": kept, "per rank (peak)": peak,
            "node leader (cache planner copy)": kept,
            "per node (kept)": kept * job.gpus_per_node + kept}


def token_bytes(shape: ModelShape) -> int:
    return 2 if shape.vocab_size <= 65536 else 4


def local_dp_ranks(job: Job) -> int:
    """dp coordinates whose samples one node reads (TP innermost, then dp; mesh.py)."""
    return max(1, min(job.dp_size, job.gpus_per_node // job.tp))


def cache_figures(shape: ModelShape, job: Job) -> dict:
    """Node cache figures.  "global": each step draws every sample from any shard, so the shards of
    the prefetch window are spread over the corpus and, unless the corpus fits the budget, nearly
    every shard a step reads is staged again (reads per epoch ~ steps x shards per step).
    "block": a node reads one block of shards at a time; two blocks must fit, and each shard is
    staged once per node per epoch."""
    shards = n_shards(job)
    shard_bytes = job.shard_tokens * token_bytes(shape)
    samples = local_dp_ranks(job) * job.micro_batch * job.grad_accum * (job.prefetch + 1)
    corpus = int(job.tokens) * token_bytes(shape)
    block = job.shuffle == "block" and shards > job.shuffle_block_shards
    if block:
        touched = min(float(shards), 2.0 * job.shuffle_block_shards)  # this block and the next
        reread = corpus * job.nodes if corpus > job.cache_budget else 0
    else:
        touched = shards * (1.0 - (1.0 - 1.0 / shards) ** samples)
        miss = max(0.0, 1.0 - job.cache_budget / corpus)
        per_step = touched / (job.prefetch + 1) * shard_bytes * miss
        reread = int(per_step * n_windows(shape, job) / job.batch) * job.nodes
    return {"corpus on disk": corpus, "shards": shards, "shard bytes": shard_bytes,
            "prefetch window (shards)": touched, "prefetch window bytes": int(touched * shard_bytes),
            "cache budget": job.cache_budget, "corpus fits the cache": corpus <= job.cache_budget,
            "PFS reads, first epoch (all nodes)": corpus * job.nodes,
            "PFS reads, each later epoch (all nodes)": 0 if corpus <= job.cache_budget
            else max(reread, corpus * job.nodes)}


def checkpoint_figures(shape: ModelShape, job: Job) -> dict:
    n = shape.total_params()
    tensors = 12 * n
    if job.sync_mode == "diloco":
        per_replica = 12 * n + (4 * n if job.overlap else 0)
        tensors = 8 * n + (4 * n if job.overlap else 0) + job.dp_size * per_replica
    if job.sync_mode == "async_diloco":
        tensors = async_model.checkpoint_bytes(job, n)
    by_layout = {layout: checkpoint_files(job, layout) for layout in ("rank", "node")}
    return {"bytes": tensors, "largest rank file (even split)": tensors // job.world,
            "largest node file (even split)": tensors // job.nodes,
            "files": by_layout[job.checkpoint_layout], "files, layout rank": by_layout["rank"],
            "files, layout node": by_layout["node"], "recommended layout": recommended_layout(job),
            "bytes on the PFS (keep + 1 being written)": tensors * (job.checkpoint_keep + 1)}


def checkpoint_files(job: Job, layout: str) -> int:
    """Files per checkpoint: a data file per rank ("rank") or per node ("node"), + the small ones."""
    return (job.world if layout == "rank" else job.nodes) + len(CHECKPOINT_SMALL_FILES)


def recommended_layout(job: Job) -> str:
    """"node" from NODE_LAYOUT_FROM_RANKS ranks when a node holds several, else "rank"."""
    return "node" if job.world >= NODE_LAYOUT_FROM_RANKS and job.gpus_per_node > 1 else "rank"
