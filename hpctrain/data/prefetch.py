"""Feeding the trainer through the node cache: what to prefetch, when to start, what to report.

Owns: opening the node cache from the config (``data.cache_dir``, ``cache_bytes``, ``prefetch``,
``prefetch_blocks``), the function from a step number to the shards this NODE's ranks will read at
that step (the sampler's order is a pure function of the step; each local rank's slice comes from
its dp rank) and to the shards they read in the block of the order that step is in (for the
cache's block look-ahead; only ``data.shuffle = "block"`` on a plain dataset: none for "global"
or a blend, whose components' blocks interleave, so a blend is staged per step only),
the validation shards pinned in the cache, telling the cache which step this rank is on, timing
how long each step waited for data, and the per-step data metrics (summed/maxed over all ranks).

Must never: decide the sample order or which samples a rank reads (sampler.split_for_rank does),
read tokens itself, or call a collective that not every rank reaches (``metrics()`` is called by
every rank once per step; ``open`` by every rank at start).
"""
from __future__ import annotations

import socket
import time

import numpy as np

from hpctrain import logs
from hpctrain.distributed.flight_recorder import RECORDER

from .cache import CacheUnavailable, NodeCache, resolve_cache_dir
from .lookahead import BlockPlan

METRIC_SUMS = ("cache_hits", "cache_misses", "cache_copies", "cache_bytes_staged",
               "cache_evictions", "cache_lookahead")


class DataFeed:
    """Per-rank glue between TrainData and the (optional) NodeCache."""

    def __init__(self, cache: NodeCache | None, device, comm=None):
        self.cache, self.device, self.comm = cache, device, comm
        self.started = False
        self.any_cached = self.all_cached = cache is not None
        self.data_s = 0.0  # time spent producing micro-batches since the last metrics()

    @classmethod
    def open(cls, cfg, ctx, dataset) -> "DataFeed":
        """Every rank calls this at start (node_comm collectives inside when the cache is on);
        ``dataset``: hpctrain.data.dataset.Dataset, data.path opened once."""
        root = resolve_cache_dir(cfg.data.cache_dir, ctx.node_rank)
        cache = None
        if root is not None:
            try:
                cache = NodeCache(root, dataset.path, dataset.manifest, ctx.node_comm,
                                  budget=cfg.data.cache_bytes, prefetch=cfg.data.prefetch,
                                  timeout_s=cfg.dist.timeout_s,
                                  prefetch_blocks=cfg.data.prefetch_blocks,
                                  manifest_bytes=dataset.manifest_bytes)
            except CacheUnavailable as e:
                if ctx.local_rank == 0:
                    logs.warning(f"warning: node {socket.gethostname()}: node cache unusable ({e}); "
                                 f"its ranks read {cfg.data.path} on the shared file system")
        feed = cls(cache, ctx.device, ctx.comm)
        # metric keys are decided on rank 0, whose node may be the one without a cache; a node
        # without one makes every rank verify the shared copy (a world collective)
        with_cache = ctx.comm.allreduce(int(cache is not None)) if root is not None else 0
        feed.any_cached, feed.all_cached = with_cache > 0, with_cache == ctx.world_size
        return feed

    @property
    def cached(self) -> bool:
        return self.cache is not None

    def bind(self, data, node_comm, val_indices, last_step: int) -> None:
        """Learn the node's dp ranks (collective on node_comm) and the pinned val shards.
        ``data``: what the plan reads (``sampler``, ``train``, ``val``, ``dp_rank``,
        ``micro_batch``, ``grad_accum``); ``val_indices()``: the fixed evaluation set's global val
        sample indices (or None); ``last_step``: where the prefetch stops."""
        self.data, self.last_step = data, last_step
        if self.cache is None:
            return
        self.local_dp = sorted(set(node_comm.allgather(data.dp_rank)))
        val_idx = val_indices()
        self.pinned = set() if val_idx is None else set(data.val.shard_ids_of(val_idx).tolist())

    def _needs(self, k: int) -> list[int]:
        d = self.data
        per = d.micro_batch * d.grad_accum
        idx = self._plan_sampler.indices_at(k)  # never the trainer's sampler: other thread
        mine = np.concatenate([idx[r * per:(r + 1) * per] for r in self.local_dp])
        return d.train.shard_ids_of(mine).tolist()

    def _block_plan(self, k: int) -> BlockPlan | None:
        """The shards of the block that step ``k`` starts in that this node's ranks read, with the
        first and last step reading each (None unless ``data.shuffle = "block"``).  A batch that
        straddles two blocks is in both plans, each with its own block's shards only."""
        s, d = self._plan_sampler, self.data  # the cache thread's own copy of the order
        if getattr(s, "shuffle", None) != "block" or not hasattr(s, "block_steps"):
            return None  # "global", or a blend (its components' blocks interleave: per step)
        a, z, block = s.block_steps(k)
        per = d.micro_batch * d.grad_accum
        idx = s.indices_between(a, z)
        mine = np.concatenate([idx[:, r * per:(r + 1) * per] for r in self.local_dp], axis=1)
        ids = d.train.shard_ids_of(mine.ravel()).reshape(mine.shape)
        return BlockPlan.of_steps(a, ids, only=np.asarray(d.train.shard_ids)[block])

    def ensure_started(self) -> None:
        """Start the leader's prefetch thread at the sampler's current step (after any resume)."""
        if self.started or self.cache is None:
            return
        self.started = True
        d = self.data
        self._plan_sampler = d.sampler.copy()  # the thread's own copy of the order
        if not self.cache.leader:
            return
        self.cache.start(d.sampler.steps_done, self.last_step, self._needs, self.pinned,
                         block_plan=self.lookahead_plan(d.sampler.state_dict()["epoch"]))

    def lookahead_plan(self, epoch: int):
        """What the cache stages a block ahead from (``_block_plan``), or None when two blocks of
        ``epoch`` do not fit the budget: then the leader warns once and stages per step only."""
        warning = self.budget_warning(epoch)
        if warning:
            logs.warning(f"warning: {self.cache.dir}: {warning}")
        return None if warning else self._block_plan

    def working_set_bytes(self, epoch: int) -> int | None:
        """Bytes of the largest two consecutive blocks of ``epoch``'s order (what the cache must
        hold to stage every shard once per epoch: the block being read and the next one); None
        where the sampler has no blocks (a blend's mixture)."""
        blocks = getattr(self.data.sampler, "blocks", None)
        if blocks is None:
            return None
        ids = np.asarray(self.data.train.shard_ids, dtype=np.int64)
        sizes = np.array([e["bytes"] for e in self.cache.entries], dtype=np.int64)
        per_block = [int(sizes[ids[b]].sum()) for b in blocks(epoch)]
        return max(a + b for a, b in zip(per_block, per_block[1:] + [0]))

    def budget_warning(self, epoch: int) -> str | None:
        """One line when the cache budget cannot hold the order's working set (leader only)."""
        need = self.working_set_bytes(epoch)
        if need is None or need <= self.cache.budget:
            return None
        s = self.data.sampler
        if s.shuffle == "global" and len(s.blocks(epoch)) == 1 and s.shard_windows.size > 1:
            return (f"data.cache_bytes={self.cache.budget} < the {need}-byte training split: with "
                    f"data.shuffle = 'global' each step reads shards from anywhere, so shards are "
                    f"staged again and again (data.shuffle = 'block' reads a block at a time)")
        return (f"data.cache_bytes={self.cache.budget} < two blocks of data.shuffle_block_shards="
                f"{s.block_shards} shards ({need} bytes): shards are staged more than once per "
                f"epoch and not a block ahead (lower data.shuffle_block_shards or raise "
                f"data.cache_bytes)")

    def begin_step(self) -> float:
        self.ensure_started()
        if self.cache is not None:
            self.cache.publish(self.data.sampler.steps_done)
        return time.perf_counter()

    def end_step(self, t0: float) -> None:
        self.data_s += time.perf_counter() - t0

    def metrics(self) -> dict:
        """This step's data metrics over all ranks: ``data_time_s`` and ``data_wait_s`` (max over
        ranks of time spent getting the batch / blocked on the cache), and with the cache: hits,
        misses (shard look-ups that had to wait), copies/bytes staged, evictions and shards staged
        a block ahead (all nodes)."""
        import torch
        import torch.distributed as dist

        c = self.cache.take_counts() if self.cache is not None else {}
        mx = torch.tensor([self.data_s, c.get("wait_s", 0.0)], dtype=torch.float64)
        sm = torch.tensor([c.get("hits", 0), c.get("misses", 0), c.get("copies", 0),
                           c.get("bytes_staged", 0), c.get("evictions", 0), c.get("lookahead", 0)],
                          dtype=torch.int64)
        self.data_s = 0.0
        size = self.comm.Get_size() if self.comm is not None else "?"
        with RECORDER.collective("data_metrics", f"world({size})"):  # the step's (MAX, SUM)
            if self.comm is not None and self.comm.Get_size() > 1:
                # host numbers over MPI, on any device: 3 us per call over shared memory where
                # Gloo's TCP takes 360 us, and on a GPU no round trip through device memory (a
                # host sync each way). A lost rank ends the job here as in the step's all-reduce
                from mpi4py import MPI

                self.comm.Allreduce(MPI.IN_PLACE, mx.numpy(), op=MPI.MAX)
                if self.any_cached:  # the same on every rank; without a cache every count is 0
                    self.comm.Allreduce(MPI.IN_PLACE, sm.numpy(), op=MPI.SUM)
            elif dist.is_initialized() and dist.get_world_size() > 1:  # no MPI communicator
                mx = mx.to(self.device)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                if self.any_cached:
                    sm = sm.to(self.device)
                    dist.all_reduce(sm, op=dist.ReduceOp.SUM)
                mx, sm = mx.cpu(), sm.cpu()
        # host tensors: read through numpy (no dispatched op)
        maxima, sums = mx.numpy().tolist(), sm.numpy().tolist()
        out = {"data_time_s": float(maxima[0]), "data_wait_s": float(maxima[1])}
        if self.any_cached:
            out.update({k: int(v) for k, v in zip(METRIC_SUMS, sums)})
        return out
