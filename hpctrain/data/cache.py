"""Node-local shard cache: every shard is read from the parallel file system once per node.

Owns: the per-node cache directory (``data.cache_dir``: auto = $SLURM_TMPDIR/$TMPDIR, ``{node}``
placeholder, one sub-directory per pretend node under HPCTRAIN_RANKS_PER_NODE), its lock and crash
leftovers, staging (copy from ``data.path`` under a temp name while hashing, sha256 checked against
the manifest, HDF5 layout checked, rename), LRU eviction under ``data.cache_bytes``, the node
leader's background thread that stages the shards of the next ``data.prefetch`` steps (the sampler
order is a pure function of the step) and then, when they fit the budget, the shards of the next
``data.prefetch_blocks`` blocks of the block order (hpctrain.data.lookahead: held until read, so a
block boundary finds its shards ready), the shared state file through which a node's ranks learn
that a shard is ready and tell the leader which step they are on, and the cache counters.

Must never: write to ``data.path``; let a rank read a shard that was not verified in this run;
evict a shard needed by a step >= the slowest local rank's step (or a pinned validation shard);
call MPI from the background thread (node_comm is used on the main thread, at start only); or
decide the sample order.  Shared state is a plain file in the cache directory (no SysV/POSIX
shared memory), so a kill -9 leaks nothing: the next start removes temp files and rebuilds state.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import sys
import threading
import time

import numpy as np

from data_tools.format import (CACHED_SHARD_RE, TMP_PREFIX, DataError, open_shard_layout,
                               sha256_file)

from .lookahead import BlockLookahead
from .shards import check_token_range

STATE, LOCK, STATS, ERROR = "state.bin", "lock", "stats.json", "error.txt"
_HDR = 4  # state.bin int64 words: magic, error flag, n_local, n_shards; then progress, ready
_MAGIC = 0x68706374726E  # "hpctrn"
COPY_BUF = 8 << 20


class CacheUnavailable(DataError):
    """The node's cache directory cannot be written or has no room for a shard: that node's ranks
    read the parallel file system instead (a warning, not an error)."""


def resolve_cache_dir(setting: str, node_rank: int) -> str | None:
    """The node's cache root for ``data.cache_dir`` (None = cache off)."""
    if setting == "auto":
        base = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or ""
    else:
        base = "" if setting in ("", "off", "none") else setting
    if not base:
        return None
    if "{node}" in base:
        return base.replace("{node}", str(node_rank))
    if os.environ.get("HPCTRAIN_RANKS_PER_NODE"):  # pretend nodes share a disk: one dir each
        return os.path.join(base, f"node{node_rank}")
    return base


def dataset_key(data_path: str) -> str:
    """Cache sub-directory name: a hash of the dataset's real path and manifest bytes (another
    dataset, a re-sharded one, or a copy elsewhere = another directory)."""
    h = hashlib.sha256(os.path.realpath(data_path).encode() + b"\0")
    with open(os.path.join(data_path, "manifest.json"), "rb") as f:
        h.update(f.read())
    return "hpctrain-" + h.hexdigest()[:16]


class NodeCache:
    """One per rank.  ``acquire(i)`` -> (local path, token offset) of manifest shard ``i``.

    Create on every rank of the node at the same time (it uses ``node_comm`` collectives once);
    the leader (local rank 0) then call ``start(k0, needs, end)`` before the first ``acquire``."""

    def __init__(self, root: str, data_path: str, manifest: dict, node_comm, budget: int = 0,
                 prefetch: int = 4, timeout_s: float = 300.0, prefetch_blocks: int = 1):
        self.data_path, self.manifest, self.entries = data_path, manifest, manifest["shards"]
        self.dir = os.path.join(root, dataset_key(data_path))
        self.local_rank, self.n_local = node_comm.Get_rank(), node_comm.Get_size()
        self.leader = self.local_rank == 0
        self.prefetch, self.timeout_s = max(0, int(prefetch)), float(timeout_s)
        self.prefetch_blocks = max(0, int(prefetch_blocks))
        self.index = {e["file"]: i for i, e in enumerate(self.entries)}
        n = len(self.entries)
        self.counts = {"hits": 0, "misses": 0, "wait_s": 0.0}  # this rank, main thread
        self.node = {"copies": 0, "bytes_staged": 0, "evictions": 0, "reused": 0, "refetched": 0,
                     "lookahead": 0}
        self.copies_per_shard: dict[str, int] = {}
        self.thread, self._stop, self._lock_fd = None, threading.Event(), None
        err = None
        if self.leader:
            try:
                self.budget = self._prepare(int(budget), n)
            except OSError as e:  # full, read-only or not ours: fall back, do not fail
                err = (CacheUnavailable, f"{self.dir}: {e.strerror or e}")
            except Exception as e:  # noqa: BLE001 - shared below so no rank hangs in the barrier
                err = (DataError, str(e) if isinstance(e, DataError) else f"{self.dir}: cache unusable ({e})")
            if err and err[0] is CacheUnavailable and self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        err = node_comm.bcast(err, root=0)
        if err:
            raise err[0](err[1])
        node_comm.Barrier()  # the leader has written a fresh state file
        self.state = np.memmap(os.path.join(self.dir, STATE), dtype=np.int64, mode="r+",
                               shape=(_HDR + self.n_local + n,))
        self.progress = self.state[_HDR:_HDR + self.n_local]
        self.ready = self.state[_HDR + self.n_local:]

    # ---- leader: directory, lock, leftovers --------------------------------------------------
    def _prepare(self, budget: int, n: int) -> int:
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:  # an flock dies with its process: a kill -9 never leaves a stale lock
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(self.dir, "node cache in use by another running job; set "
                                      "data.cache_dir to another directory") from None
        self.unverified, used = {}, 0
        for name in os.listdir(self.dir):
            full = os.path.join(self.dir, name)
            if name in (LOCK, STATS):
                continue
            if name in self.index:  # left by an earlier run: checked again before first use
                self.unverified[self.index[name]] = None
                used += os.path.getsize(full)
            elif (name.startswith(TMP_PREFIX) or name in (STATE, ERROR)
                  or CACHED_SHARD_RE.match(name)):
                os.unlink(full)  # a crash's temp file, old state, or a shard of no interest
        st = os.statvfs(self.dir)
        room = st.f_bavail * st.f_frsize + used
        if budget <= 0:  # auto: 90% of what the file system can hold for us
            budget = int(0.9 * room)
        largest = max((e["bytes"] for e in self.entries), default=0)
        if room < largest:
            raise OSError(28, f"no room for a shard ({room} bytes free, the largest needs {largest})")
        self.used = used
        self.lru: dict[int, int] = {i: -1 for i in self.unverified}  # shard -> last step needed
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-{STATE}")
        state = np.zeros(_HDR + self.n_local + n, dtype=np.int64)
        state[:_HDR] = (_MAGIC, 0, self.n_local, n)
        state[_HDR:_HDR + self.n_local] = -1
        state.tofile(tmp)
        os.replace(tmp, os.path.join(self.dir, STATE))
        self._write_stats()
        return budget

    # ---- every rank ----------------------------------------------------------------------------
    def path_of(self, i: int) -> str:
        return os.path.join(self.dir, self.entries[i]["file"])

    def publish(self, k: int) -> None:
        """This rank is about to read the batch of step ``k`` (monotonic)."""
        self.progress[self.local_rank] = k

    def acquire(self, i: int) -> tuple[str, int]:
        """Path and token offset of shard ``i`` in the cache; waits until the leader staged it."""
        off = int(self.ready[i])
        if off > 0:
            self.counts["hits"] += 1
            return self.path_of(i), off
        self.counts["misses"] += 1
        t0 = time.perf_counter()
        delay = 0.0005
        while off == 0 and not self.state[1]:
            if time.perf_counter() - t0 > self.timeout_s:
                raise DataError(self.path_of(i), f"not staged by the node leader within "
                                                 f"{self.timeout_s:.0f}s (dist.timeout_s)")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            off = int(self.ready[i])
        self.counts["wait_s"] += time.perf_counter() - t0
        if off <= 0 or self.state[1]:
            raise DataError(self._error_message())
        return self.path_of(i), off

    def _error_message(self) -> str:
        try:
            with open(os.path.join(self.dir, ERROR), encoding="utf-8") as f:
                return f.read().strip() or f"{self.dir}: node cache failed"
        except OSError:
            return f"{self.dir}: node cache failed on the node leader"

    def take_counts(self) -> dict:
        """Counters since the last call: this rank's hits/misses/wait, the node's staging work
        (leader only; other ranks report zeros so sums over ranks count each node once)."""
        out = dict(self.counts)
        self.counts = {"hits": 0, "misses": 0, "wait_s": 0.0}
        node = dict(self.node) if self.leader else dict.fromkeys(self.node, 0)
        prev = getattr(self, "_node_prev", dict.fromkeys(self.node, 0))
        self._node_prev = node
        out.update({k: node[k] - prev[k] for k in node})
        return out

    # ---- leader: the prefetch thread -----------------------------------------------------------
    def start(self, k0: int, end: int, needs, pinned=(), block_plan=None,
              background: bool = True) -> None:
        """Leader only (no-op elsewhere): stage ``pinned`` shards, then the shards ``needs(k)`` of
        steps k0, k0+1, ... < end, staying at most ``prefetch`` steps ahead of the fastest rank,
        and, when those are staged, the next ``prefetch_blocks`` blocks of ``block_plan(k)``
        (-> BlockPlan of the block step k starts in, or None: no blocks) if they fit the budget.
        ``background=False``: no thread; the caller stages the pinned shards and calls ``work()``
        (a step-by-step simulation of the thread, for tests and benchmarks)."""
        if not self.leader or self.thread is not None:
            return
        self._needs, self._need_cache, self.pinned = needs, {}, set(pinned)
        self.k0, self.end = int(k0), int(end)
        self.k = self.k0  # the next step whose shards the thread stages
        sizes = [e["bytes"] for e in self.entries]
        self.ahead = (BlockLookahead(block_plan, self.prefetch_blocks, self.end, sizes)
                      if block_plan is not None and self.prefetch_blocks > 0 else None)
        if not background:
            return
        self.thread = threading.Thread(target=self._run, name="hpctrain-cache", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        self._stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)

    def _needs_at(self, k: int) -> list[int]:
        if k not in self._need_cache:
            self._need_cache[k] = list(dict.fromkeys(int(i) for i in self._needs(k)))
        return self._need_cache[k]

    def _run(self) -> None:
        try:
            self.stage_pinned()
            while self.k < self.end and not self._stop.is_set():
                if not self.work():
                    time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001 - handed to every rank of the node
            msg = str(e) if isinstance(e, DataError) else f"{self.dir}: staging failed: {e!r}"
            with open(os.path.join(self.dir, ERROR), "w", encoding="utf-8") as f:
                f.write(msg + "\n")
            self.state[1] = 1

    def stage_pinned(self) -> None:
        for i in sorted(self.pinned):
            self._ensure(i, self.pinned, must=True, step=-1)

    def work(self) -> bool:
        """One unit of the leader's staging: a shard of step ``self.k`` made ready (or the step
        found complete), else one look-ahead shard.  False = nothing to do until the ranks move
        on (at the prefetch horizon with nothing to stage ahead, or no room yet)."""
        if self.k >= self.end:
            return False
        prog = self.progress.copy()
        pmin, pmax = max(self.k0, int(prog.min())), max(self.k0, int(prog.max()))
        for old in [s for s in self._need_cache if s < pmin]:
            del self._need_cache[old]
        held = self.ahead.held_from(pmin) if self.ahead is not None else set()
        if self.k > pmax + self.prefetch:
            return self._stage_ahead(pmin, held)
        protect = set(self.pinned) | held
        for s in range(pmin, self.k + 1):
            protect.update(self._needs_at(s))
        for i in self._needs_at(self.k):
            if self.ready[i] > 0:
                self._ensure(i, protect, must=False, step=self.k)  # marks it recently used
            else:  # no room until the slowest rank moves on: False
                return self._ensure(i, protect, must=self.k <= pmin, step=self.k)
        self.k += 1
        return True

    def _stage_ahead(self, pmin: int, held: set) -> bool:
        """Stage the next shard of the next blocks, evicting nothing the node still needs."""
        if self.ahead is None:
            return False
        needed = set(self.pinned)
        for s in range(pmin, self.k):
            needed.update(self._needs_at(s))
        got = self.ahead.next_shard(pmin, needed, self.budget, lambda i: self.ready[i] > 0)
        if got is None:
            return False
        i, first = got
        if not self._ensure(i, needed | self.ahead.held_from(pmin), must=False, step=first):
            return False
        self.node["lookahead"] += 1
        return True

    def _ensure(self, i: int, protect: set, must: bool, step: int) -> bool:
        """Make shard ``i`` ready (evicting LRU shards outside ``protect``); False = no room yet."""
        if self.ready[i] > 0:
            self.lru.pop(i, None)
            self.lru[i] = step
            return True
        size = self.entries[i]["bytes"] if i not in self.unverified else 0
        while self.used + size > self.budget:
            victim = next((j for j in self.lru if j not in protect and j != i), None)
            if victim is None:
                if not must:
                    return False
                if not getattr(self, "_warned", False):
                    print(f"warning: {self.dir}: data.cache_bytes={self.budget} is smaller than "
                          f"one step's shards; going over it", file=sys.stderr, flush=True)
                    self._warned = True
                break
            self._evict(victim)
        self._stage(i)
        self.lru.pop(i, None)
        self.lru[i] = step
        return True

    def _evict(self, j: int) -> None:
        self.ready[j] = 0
        path = self.path_of(j)
        self.used -= os.path.getsize(path) if os.path.exists(path) else 0
        self.unverified.pop(j, None)
        self.lru.pop(j, None)
        if os.path.exists(path):
            os.unlink(path)
        self.node["evictions"] += 1
        self._write_stats()

    def _stage(self, i: int) -> None:
        e = self.entries[i]
        # A blend's shards live in its components: data_manifest gives each a "src" path and a
        # cache name "c<component>-<file>", so components never collide in one cache directory.
        dst, src = self.path_of(i), e.get("src") or os.path.join(self.data_path, e["file"])
        if i in self.unverified:  # from an earlier run: trust it only after a full check
            del self.unverified[i]
            ok = os.path.getsize(dst) == e["bytes"] and sha256_file(dst) == e["sha256"]
            if ok:
                self.node["reused"] += 1
                self.ready[i] = self._checked_offset(dst, e, dst)
                self._write_stats()
                return
            self.used -= os.path.getsize(dst)
            os.unlink(dst)
            self.node["refetched"] += 1
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-{e['file']}")
        h, n = hashlib.sha256(), 0
        try:
            with open(src, "rb", buffering=0) as fin, open(tmp, "wb", buffering=0) as fout:
                buf = bytearray(COPY_BUF)
                view = memoryview(buf)
                while True:
                    got = fin.readinto(buf)
                    if not got:
                        break
                    h.update(view[:got])
                    fout.write(view[:got])
                    n += got
        except FileNotFoundError:
            raise DataError(src, "missing (listed in manifest)") from None
        if n != e["bytes"] or h.hexdigest() != e["sha256"]:
            os.unlink(tmp)
            what = (f"truncated ({n} bytes, manifest says {e['bytes']})" if n < e["bytes"] else
                    f"sha256 mismatch (manifest {e['sha256'][:12]}…, file {h.hexdigest()[:12]}…)")
            raise DataError(src, what + " while staging into the node cache")
        os.replace(tmp, dst)
        self.used += n
        offset = self._checked_offset(dst, e, src)
        self.node["copies"] += 1
        self.node["bytes_staged"] += n
        self.copies_per_shard[e["file"]] = self.copies_per_shard.get(e["file"], 0) + 1
        self.ready[i] = offset
        self._write_stats()

    def _checked_offset(self, path: str, e: dict, name: str) -> int:
        """HDF5 attrs/layout against the manifest, then every token id < vocab_size (once per
        node, so readers need not check); returns the tokens' byte offset."""
        lay = open_shard_layout(path, e, self.manifest)
        toks = np.memmap(path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(lay.n_tokens,))
        check_token_range(toks, self.manifest["tokenizer"]["vocab_size"], name)
        del toks
        return lay.offset

    def _write_stats(self) -> None:
        """stats.json: this run's staging work on this node (copies per shard, counters)."""
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-{STATS}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"copies_per_shard": self.copies_per_shard, **self.node, "budget": self.budget
                       if hasattr(self, "budget") else 0, "used": self.used}, f, sort_keys=True)
        os.replace(tmp, os.path.join(self.dir, STATS))
