"""Node-local shard cache: every shard is read from the parallel file system once per node.

Owns: the node's cache folder ``<cache_dir>/hpctrain-<uid>/<dataset key>`` (``data.cache_dir``:
auto = $SLURM_TMPDIR/$TMPDIR, ``{node}`` placeholder, one sub-directory per pretend node under
HPCTRAIN_RANKS_PER_NODE; opened by hpctrain.data.private_dir: a planted symlink or another
user's folder is refused, and the node reads data.path), its lock and crash leftovers (files
others could have written are removed, never reused), staging (hpctrain.data.staging: copy from
``data.path`` while hashing, sha256 checked against the manifest, HDF5 layout and token range
checked, rename), falling back to data.path for the rest of the run when the cache disk fills or
turns read-only (one warning; the leader then verifies each shard on data.path instead of copying
it), LRU eviction under ``data.cache_bytes``, the node
leader's background thread that stages the shards of the next ``data.prefetch`` steps (the sampler
order is a pure function of the step) and then, when they fit the budget, the shards of the next
``data.prefetch_blocks`` blocks of the block order (hpctrain.data.lookahead: held until read, so a
block boundary finds its shards ready), the shared state file through which a node's ranks learn
that a shard is ready and tell the leader which step they are on, and the cache counters.

Must never: write to ``data.path``; follow a symlink or use a folder or file another user could
have put or changed; let a rank read a shard that was not verified in this run;
evict a shard needed by a step >= the slowest local rank's step (or a pinned validation shard);
call MPI from the background thread (node_comm is used on the main thread, at start only); or
decide the sample order.  Shared state is a plain file in the cache directory (no SysV/POSIX
shared memory), so a kill -9 leaks nothing: the next start removes temp files and rebuilds state.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import stat
import threading
import time

import numpy as np

from data_tools.format import (CACHED_SHARD_RE, TMP_PREFIX, DataError, open_shard_layout,
                               sha256_file)

from hpctrain import logs

from .lookahead import BlockLookahead
from .private_dir import (UnsafeDir, dataset_key, open_private_dir, resolve_cache_dir,  # noqa: F401
                          trusted_file, user_root_name)
from .shards import check_file_token_range
from .staging import CacheWriteFailed, check_copy, copy_and_hash, unlink_quietly, write_file

STATE, LOCK, STATS, ERROR = "state.bin", "lock", "stats.json", "error.txt"
_HDR = 4  # state.bin int64 words: magic, error flag, n_local, n_shards; then progress, ready
_MAGIC = 0x68706374726E  # "hpctrn"
SHARED = 1 << 48  # in ready[i]: the leader verified shard i on data.path (the cache is full)


class CacheUnavailable(DataError):
    """The node's cache directory cannot be written, has no room for a shard, or is not safe to
    use (hpctrain.data.private_dir): that node's ranks read the parallel file system instead (a
    warning, not an error)."""


class NodeCache:
    """One per rank.  ``acquire(i)`` -> (local path, token offset) of manifest shard ``i``.

    Create on every rank of the node at the same time (it uses ``node_comm`` collectives once);
    the leader (local rank 0) then call ``start(k0, needs, end)`` before the first ``acquire``."""

    def __init__(self, root: str, data_path: str, manifest: dict, node_comm, budget: int = 0,
                 prefetch: int = 4, timeout_s: float = 300.0, prefetch_blocks: int = 1,
                 manifest_bytes: bytes | None = None):
        self.data_path, self.manifest, self.entries = data_path, manifest, manifest["shards"]
        self.root, self.dir_fd = root, None
        self.dir = os.path.join(root, user_root_name(), dataset_key(data_path, manifest_bytes))
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
        self.shared_only, self._error = False, None  # shared_only: staging stopped (disk full)
        err = None
        if self.leader:
            try:
                self.budget = self._prepare(int(budget), n)
            except UnsafeDir as e:  # a planted symlink, another user's folder: fall back
                err = (CacheUnavailable, str(e))
            except OSError as e:  # full, read-only or not ours: fall back, do not fail
                err = (CacheUnavailable, f"{self.dir}: {e.strerror or e}")
            except Exception as e:  # noqa: BLE001 - shared below so no rank hangs in the barrier
                err = (DataError, str(e) if isinstance(e, DataError) else f"{self.dir}: cache unusable ({e})")
            if err and err[0] is CacheUnavailable:
                for fd in (self._lock_fd, self.dir_fd):
                    if fd is not None:
                        os.close(fd)
                self._lock_fd = self.dir_fd = None
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
        self.dir_fd, _ = open_private_dir(self.root, [user_root_name(), os.path.basename(self.dir)])
        self._lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                dir_fd=self.dir_fd)
        try:  # an flock dies with its process: a kill -9 never leaves a stale lock
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(self.dir, "node cache in use by another running job; set "
                                      "data.cache_dir to another directory") from None
        self.unverified, used = {}, 0
        for name in os.listdir(self.dir_fd):
            if name in (LOCK, STATS):
                continue
            if not trusted_file(self.dir_fd, name):  # a symlink, or writable by others: never used
                st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=self.dir_fd)
            elif name in self.index:  # left by an earlier run: checked again before first use
                self.unverified[self.index[name]] = None
                used += os.stat(name, dir_fd=self.dir_fd).st_size
            elif (name.startswith(TMP_PREFIX) or name in (STATE, ERROR)
                  or CACHED_SHARD_RE.match(name)):
                os.unlink(name, dir_fd=self.dir_fd)  # a crash's temp file, old state, stale shard
        st = os.statvfs(self.dir_fd)
        room = st.f_bavail * st.f_frsize + used
        if budget <= 0:  # auto: 90% of what the file system can hold for us
            budget = int(0.9 * room)
        largest = max((e["bytes"] for e in self.entries), default=0)
        if room < largest:
            raise OSError(28, f"no room for a shard ({room} bytes free, the largest needs {largest})")
        self.used = used
        self.lru: dict[int, int] = {i: -1 for i in self.unverified}  # shard -> last step needed
        state = np.zeros(_HDR + self.n_local + n, dtype=np.int64)
        state[:_HDR] = (_MAGIC, 0, self.n_local, n)
        state[_HDR:_HDR + self.n_local] = -1
        write_file(self.dir_fd, STATE, state.tobytes())
        self.budget = budget
        self._write_stats()
        return budget

    # ---- every rank ----------------------------------------------------------------------------
    def path_of(self, i: int) -> str:
        return os.path.join(self.dir, self.entries[i]["file"])

    def source_of(self, i: int) -> str:
        """Shard ``i`` on data.path (a blend's shards: in their component, "src")."""
        e = self.entries[i]
        return e.get("src") or os.path.join(self.data_path, e["file"])

    def _located(self, i: int, ready: int) -> tuple[str, int]:
        """(path, token offset) from ``ready[i]``: the cached copy, or data.path's (SHARED)."""
        if ready & SHARED:
            return self.source_of(i), ready & ~SHARED
        return self.path_of(i), ready

    def publish(self, k: int) -> None:
        """This rank is about to read the batch of step ``k`` (monotonic)."""
        self.progress[self.local_rank] = k

    def acquire(self, i: int) -> tuple[str, int]:
        """Path and token offset of shard ``i`` in the cache; waits until the leader staged it."""
        off = int(self.ready[i])
        if off > 0:
            self.counts["hits"] += 1
            return self._located(i, off)
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
        return self._located(i, off)

    def _error_message(self) -> str:
        if self._error:  # the leader's own thread failed: no need for the file
            return self._error
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
            self._error = (str(e) if isinstance(e, DataError)
                           else f"{self.dir}: staging failed: {e!r}")
            try:  # the other ranks read it; where it cannot be written they say less
                write_file(self.dir_fd, ERROR, (self._error + "\n").encode())
            except OSError:
                pass
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
        size = self.entries[i]["bytes"] if i not in self.unverified and not self.shared_only else 0
        while self.used + size > self.budget:
            victim = next((j for j in self.lru if j not in protect and j != i), None)
            if victim is None:
                if not must:
                    return False
                if not getattr(self, "_warned", False):
                    logs.warning(f"warning: {self.dir}: data.cache_bytes={self.budget} is smaller "
                                 f"than one step's shards; going over it")
                    self._warned = True
                break
            self._evict(victim)
        self._stage(i)
        self.lru.pop(i, None)
        self.lru[i] = step
        return True

    def _evict(self, j: int) -> None:
        self.ready[j] = 0
        name = self.entries[j]["file"]
        try:
            self.used -= os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False).st_size
            os.unlink(name, dir_fd=self.dir_fd)
        except FileNotFoundError:  # verified on data.path (SHARED): nothing in the cache
            pass
        self.unverified.pop(j, None)
        self.lru.pop(j, None)
        self.node["evictions"] += 1
        self._write_stats()

    def _stage(self, i: int) -> None:
        e = self.entries[i]
        # A blend's shards live in its components: data_manifest gives each a "src" path and a
        # cache name "c<component>-<file>", so components never collide in one cache directory.
        dst, src = self.path_of(i), self.source_of(i)
        if i in self.unverified:  # from an earlier run: trust it only after a full check
            del self.unverified[i]
            if os.path.getsize(dst) == e["bytes"] and sha256_file(dst) == e["sha256"]:
                self.node["reused"] += 1
                self.ready[i] = self._checked_offset(dst, e, dst)
                self._write_stats()
                return
            self.used -= os.path.getsize(dst)
            os.unlink(e["file"], dir_fd=self.dir_fd)
            self.node["refetched"] += 1
        tmp = f"{TMP_PREFIX}{os.getpid()}-{e['file']}"
        if not self.shared_only:
            try:
                check_copy(src, e, *copy_and_hash(src, self.dir_fd, tmp))
                os.replace(tmp, e["file"], src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            except CacheWriteFailed as err:
                self._fall_back(str(err))
            except BaseException:
                unlink_quietly(self.dir_fd, tmp)
                raise
        if self.shared_only:  # no room (or read-only): check data.path's shard, read it there
            check_copy(src, e, *copy_and_hash(src, self.dir_fd, None))
            self.ready[i] = self._checked_offset(src, e, src) | SHARED
            return
        self.used += e["bytes"]
        offset = self._checked_offset(dst, e, src)
        self.node["copies"] += 1
        self.node["bytes_staged"] += e["bytes"]
        self.copies_per_shard[e["file"]] = self.copies_per_shard.get(e["file"], 0) + 1
        self.ready[i] = offset
        self._write_stats()

    def _fall_back(self, reason: str) -> None:
        """Staging stops for good (the cache disk is full or read-only): one warning; shards not
        yet staged are verified on data.path and read there."""
        if not self.shared_only:
            self.shared_only = True
            logs.warning(f"warning: node {socket.gethostname()}: node cache {self.dir}: {reason}; "
                         f"its ranks read {self.data_path} on the shared file system from now on")

    def _checked_offset(self, path: str, e: dict, name: str) -> int:
        """HDF5 attrs/layout against the manifest, then every token id < vocab_size (once per
        node, so readers need not check); returns the tokens' byte offset."""
        lay = open_shard_layout(path, e, self.manifest)
        check_file_token_range(path, lay.offset, lay.n_tokens, lay.dtype,
                               self.manifest["tokenizer"]["vocab_size"], name)
        return lay.offset

    def _write_stats(self) -> None:
        """stats.json: this run's staging work on this node (copies per shard, counters); none
        once staging stopped (nothing more is written into a full cache directory)."""
        if self.shared_only:
            return
        data = json.dumps({"copies_per_shard": self.copies_per_shard, **self.node,
                           "budget": getattr(self, "budget", 0), "used": self.used}, sort_keys=True)
        try:
            write_file(self.dir_fd, STATS, data.encode())
        except OSError as err:
            self._fall_back(f"cannot write {STATS} ({err.strerror or err})")
