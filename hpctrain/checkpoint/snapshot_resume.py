"""Resuming from peer snapshots (the relaunch side of snapshot.py): which snapshot the surviving
nodes can rebuild, every node's copy checked against COMMIT.json's checksums BEFORE anything is
loaded, a damaged or missing file replaced by a node's intact copy, and the path this node loads.

Owns the order: one allgather of what every node holds (snapshot_io.list_node) -> the newest
snapshot the survivors cover (snapshot_io.choose) -> each node's ranks hash their share of their
node's copy (one allgather of what failed) -> a damaged copy counts as absent on that node and the
choice is made again, so the file comes from a node whose copy is intact (snapshot_io.transfers)
-> the files each node lacks sent node to node -> one allgather of the errors.

It must never load anything (the trainer does, after this returns) or hand back a snapshot some
copy of which failed its checksum and has not been replaced: a damaged snapshot must never seed
a run, not even partly (a failed load writes into the model in place).
"""
from __future__ import annotations

from pathlib import Path

from hpctrain import logs
from hpctrain.checkpoint import disk_format, snapshot_io
from hpctrain.checkpoint.dcp_io import describe

log = logs.get_logger(__name__)


def damaged_share(folder: Path, commit: dict, names: list[str], local_rank: int, local_size: int) -> dict:
    """{file: problem} among this rank's share (every local_size-th of the sorted `names`, from
    `local_rank`) of the files in `folder` whose bytes do not match COMMIT.json's checksum."""
    entries = commit.get("files") or {}
    problems = {}
    for rel in sorted(names)[local_rank::max(local_size, 1)]:
        try:
            problem = disk_format.hash_problem(folder, rel, entries.get(rel) or {})
        except OSError as e:
            problem = f"{rel} cannot be read ({describe(e)})"
        if problem:
            problems[rel] = problem
    return problems


def drop_damaged(listings: list, step: int, damage: list) -> None:
    """Remove from `listings` (one (node, list_node()) per node, in place) the files of snapshot
    `step` that a node found damaged: `damage` holds one (node, {file: problem}) per rank."""
    for node, found in damage:
        for n, listing in listings:
            if n == node and step in listing:
                for rel in found:
                    listing[step]["files"].pop(rel, None)


class SnapshotResume:
    """The relaunch of PeerSnapshots `snaps`: `run(pfs_step)` -> (path of this node's complete,
    checked copy or None, why a snapshot found was not used or None)."""

    def __init__(self, snaps):
        self.snaps, self.ctx = snaps, snaps.ctx
        self.damaged: dict = {}  # (step, file) -> "is damaged on node N (...)", for the lines

    def run(self, pfs_step) -> tuple[Path | None, str | None]:
        snaps = self.snaps
        topo = snaps.topology()
        leader = snaps.rank == topo["leaders"][self.ctx.node_rank]
        mine = snapshot_io.list_node(snaps.path) if leader and not snaps.path.is_symlink() else {}
        listings = [x for x in self.ctx.comm.allgather((self.ctx.node_rank, mine if leader else None))
                    if x[1] is not None]
        checked = set()
        while True:
            step, *found = snapshot_io.choose(listings, snaps.key, self.damaged)
            if step is None:
                return None, (found[0][0] if found[0] else None)
            if step in checked:
                break
            if pfs_step() >= step:
                return None, None
            checked.add(step)
            damage = self._check_copies(step, found[0], listings)
            if not damage:
                break
            drop_damaged(listings, step, damage)
        commit, holders = found
        self._say_replaced(step, holders)
        return self._complete(step, snapshot_io.transfers(holders, topo["leaders"]))

    def _check_copies(self, step: int, commit: dict, listings: list) -> list:
        """Collective: every node's copy of snapshot `step` hashed by the node's ranks (a share
        each); [(node, {file: problem})] of every rank that found damage (the same on all)."""
        snaps, ctx = self.snaps, self.ctx
        here = next((lst for n, lst in listings if n == ctx.node_rank), {})
        names = [rel for rel in (here.get(step) or {}).get("files", {})
                 if rel in (commit.get("files") or {})]
        folder = snaps.path / disk_format.step_dir_name(step)
        mine = damaged_share(folder, commit, names, ctx.local_rank, ctx.local_size) if names else {}
        damage = [(node, found) for node, found in ctx.comm.allgather((ctx.node_rank, mine)) if found]
        for node, found in damage:
            for rel, problem in found.items():
                self.damaged.setdefault((step, rel), f"is damaged on node {node} ({problem})")
        return damage

    def _say_replaced(self, step: int, holders: dict) -> None:
        if self.damaged and self.snaps.rank == 0:
            for (at, rel), why in sorted(self.damaged.items()):
                if at == step and holders.get(rel):
                    log.info(f"peer snapshot of step {step}: {rel} {why}; using node "
                             f"{holders[rel][0]}'s intact copy")

    def _complete(self, step: int, moves: list) -> tuple[Path | None, str | None]:
        """Collective: the files each node lacks (or holds damaged) copied from a node that holds
        them intact; this node's path, or (None, why) on any rank's failure."""
        err = None
        try:
            self._fetch_missing(step, moves)
        except Exception as e:  # noqa: BLE001 - agreed below
            err = describe(e)
        errors = self.ctx.comm.allgather(err)  # the others read this node's copy after this
        bad = next(((r, e) for r, e in enumerate(errors) if e), None)
        if bad:
            return None, f"step {step}: rank {bad[0]}: {bad[1]}"
        return self.snaps.path / disk_format.step_dir_name(step), None

    def _fetch_missing(self, step: int, moves: list) -> None:
        """Copy the files a node lacks from a node that holds them (pairs of send/recv in the
        same order on every rank), so that every node's folder holds the whole snapshot. A
        damaged copy is replaced (the received file is renamed over it)."""
        if not moves:
            return
        snaps = self.snaps
        group = snaps.group()
        folder = snaps.path / disk_format.step_dir_name(step)
        for rel, src, dst in moves:
            if snaps.rank == src:
                snapshot_io.send_file(folder / rel, dst, group)
            elif snaps.rank == dst:
                if not folder.is_dir():
                    snaps._open_root()
                    folder.mkdir(exist_ok=True)
                snapshot_io.recv_file(folder / rel, src, group)
