"""Choosing a peer snapshot from the nodes' listings and moving its files (snapshot_io.py): which
step a relaunch resumes from, what is named when none is complete, which node sends what."""
import json

import pytest

from hpctrain.checkpoint import snapshot_io
from hpctrain.checkpoint.snapshot import node_root_path, run_key

KEY = "k" * 16
FILES = {"__0_0.distcp": {"size": 10}, "__1_0.distcp": {"size": 12}, ".metadata": {"size": 3}}


def _listing(step, commit=True, files=FILES, run=KEY, held=None):
    """A node's list_node() entry: the marker lists `files`; the node holds `held` (all)."""
    marker = {"step": step, "run": run, "files": files} if commit else None
    held = {name: e["size"] for name, e in files.items() if held is None or name in held}
    return {step: {"commit": marker, "files": held}}


def test_newest_covered_snapshot_is_chosen_and_missing_files_come_from_a_holder():
    node0 = {**_listing(4), **_listing(6, held={"__0_0.distcp", ".metadata"})}
    node1 = _listing(6, commit=False, held={"__1_0.distcp"})  # its own file, no marker
    step, commit, holders = snapshot_io.choose([(0, node0), (1, node1)], KEY)
    assert step == 6 and holders["__1_0.distcp"] == [1] and holders["COMMIT.json"] == [0]
    moves = snapshot_io.transfers(holders, {0: 0, 1: 2})  # node 1's leader is rank 2
    assert moves == [("__1_0.distcp", 2, 0), (".metadata", 0, 2), ("__0_0.distcp", 0, 2),
                     ("COMMIT.json", 0, 2)]


@pytest.mark.parametrize("listing, named", [
    (_listing(6, commit=False), "step_00000006/COMMIT.json is missing"),
    (_listing(6, run="other"), "step_00000006/COMMIT.json is of another run"),
    (_listing(6, files={**FILES, "__2_0.distcp": {"size": 5}}), "step_00000006/__2_0.distcp is on no"),
])
def test_incomplete_snapshot_is_refused_naming_what_it_lacks(listing, named):
    if named.endswith("is on no"):  # the marker lists a file no node holds
        listing[6]["files"].pop("__2_0.distcp")
    step, problems = snapshot_io.choose([(0, listing)], KEY)
    assert step is None and problems[0].startswith(named)


def test_a_file_of_the_wrong_size_does_not_count():
    listing = _listing(6)
    listing[6]["files"]["__1_0.distcp"] = 11  # truncated
    assert snapshot_io.choose([(0, listing)], KEY)[0] is None


def test_list_node_reads_markers_and_ignores_tmp(tmp_path):
    (tmp_path / "step_00000006").mkdir()
    (tmp_path / "step_00000006" / "COMMIT.json").write_text(json.dumps({"run": KEY}))
    (tmp_path / "step_00000006" / "__0_0.distcp").write_bytes(b"x" * 7)
    (tmp_path / "step_00000008.tmp").mkdir()
    found = snapshot_io.list_node(tmp_path)
    assert list(found) == [6] and found[6]["files"]["__0_0.distcp"] == 7
    assert found[6]["commit"] == {"run": KEY}
    assert snapshot_io.list_node(tmp_path / "absent") == {}


def test_pack_unpack_round_trip_refuses_other_names(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir(), dst.mkdir()
    (src / "__3_0.distcp").write_bytes(b"abc")
    (src / ".metadata").write_bytes(b"")
    header, body = snapshot_io.pack(src, ["__3_0.distcp", ".metadata"])
    assert snapshot_io.unpack(dst, header, body) == ["__3_0.distcp", ".metadata"]
    assert (dst / "__3_0.distcp").read_bytes() == b"abc"
    with pytest.raises(ValueError, match="refusing"):
        snapshot_io.unpack(dst, json.dumps([["../evil", 0]]).encode(), b"")


def test_node_folder_placeholder_and_pretend_nodes(monkeypatch, tmp_path):
    monkeypatch.delenv("HPCTRAIN_RANKS_PER_NODE", raising=False)
    path = node_root_path(f"{tmp_path}/n{{node}}", "/runs/a", 3)
    assert path.parent.parent == tmp_path / "n3" and path.name == f"snapshots-{run_key('/runs/a')}"
    monkeypatch.setenv("HPCTRAIN_RANKS_PER_NODE", "2")
    assert node_root_path(str(tmp_path), "/runs/a", 1).parent.parent == tmp_path / "node1"
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "job"))
    assert str(node_root_path("auto", "/runs/a", 0)).startswith(str(tmp_path / "job"))
    assert run_key("/runs/a") != run_key("/runs/b")


def test_a_snapshot_that_would_crowd_node_memory_is_refused_naming_the_folder(tmp_path):
    import shutil

    from hpctrain.checkpoint.snapshot import ROOM_RESERVE, room_problem

    usage = shutil.disk_usage(tmp_path)
    folder = tmp_path / "hpctrain-0" / "snapshots-x"  # not made yet: its nearest existing parent counts
    assert room_problem(folder, 0) is None or usage.free < ROOM_RESERVE * usage.total
    fits = int(usage.free - ROOM_RESERVE * usage.total) // 2
    crowds = int(usage.free - ROOM_RESERVE * usage.total) + 2**30
    if fits > 0:
        assert room_problem(folder, fits) is None
    problem = room_problem(folder, crowds)
    assert problem is not None and str(tmp_path) in problem and "snapshot_interval" in problem


def _tree(folder):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_a_stale_leader_writes_nothing_into_the_newer_launchs_snapshot_folder(tmp_path, monkeypatch):
    """The node folder is the run's (a relaunch reuses it): once a newer launch holds the run lock, a
    rank of the older one (frozen past the relaunch) ends with exit 2 at its next snapshot write —
    COMMIT.json, the rename that would replace and prune the newer launch's steps, a received file,
    an unpacked one — and the folder is exactly as the newer launch left it."""
    import os
    import types

    import torch

    from hpctrain.checkpoint import disk_format
    from hpctrain.checkpoint.snapshot import PeerSnapshots
    from hpctrain.distributed import run_lock

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", _exit)
    run, folder = tmp_path / "run", tmp_path / "node0"
    run.mkdir(), folder.mkdir()
    ctx = types.SimpleNamespace(rank=0, world_size=1, node_rank=0, comm=None)
    snaps = PeerSnapshots(0, "auto", str(run), ctx, enabled=False)
    snaps.path = folder
    with run_lock.hold(run, ctx):
        ours = disk_format.tmp_path(folder / "step_00000800", run_lock.launch_id())
        ours.mkdir()
        snapshot_io.write_tensor(ours / "__0_0.distcp", torch.tensor([1, 2], dtype=torch.uint8))
        snaps._mark_complete(800, ours, {"__0_0.distcp": {"size": 2}})  # ours: committed
        assert (folder / "step_00000800" / "COMMIT.json").exists() and not ours.exists()
        stale = disk_format.tmp_path(folder / "step_00000850", run_lock.launch_id())
        stale.mkdir()
        newer = folder / "step_00000900"  # the newer launch's committed snapshot
        newer.mkdir()
        (newer / "COMMIT.json").write_text('{"step": 900}')
        (newer / "__0_0.distcp").write_bytes(b"new")
        (newer / ".metadata").write_bytes(b"meta")
        (run / "newer").write_text('{"host": "h2", "pid": 4242, "job": null, "started": 1.0}\n')
        os.replace(run / "newer", run / run_lock.LOCK_NAME)  # the newer launch took the run dir over
        before = _tree(folder)
        writes = [lambda: snaps._mark_complete(850, stale, {}),
                  lambda: snapshot_io.write_tensor(newer / "__0_0.distcp", torch.tensor([7], dtype=torch.uint8)),
                  lambda: snapshot_io.unpack(newer, *snapshot_io.pack(newer, [".metadata"]))]
        for write in writes:
            with pytest.raises(SystemExit) as stopped:
                write()
            assert stopped.value.code == 2
        assert _tree(folder) == before


def test_a_damaged_copy_is_dropped_so_the_intact_copy_is_sent_and_its_damage_named(tmp_path):
    """Node 0's copy of __0_0.distcp fails its checksum (damaged_share), node 1's passes: dropped
    from node 0's listing, the file comes from node 1; damaged on both: named as damaged."""
    from hpctrain.checkpoint import disk_format
    from hpctrain.checkpoint.snapshot_resume import damaged_share, drop_damaged
    (tmp_path / "__0_0.distcp").write_bytes(b"0123456789")
    good = disk_format.hash_file(tmp_path / "__0_0.distcp", disk_format.DATA_HASH)
    files = {**FILES, "__0_0.distcp": {"size": 10, disk_format.DATA_HASH: good}}
    (tmp_path / "__0_0.distcp").write_bytes(b"0123456780")
    found = damaged_share(tmp_path, {"files": files}, ["__0_0.distcp"], 0, 1)
    assert list(found) == ["__0_0.distcp"] and "xxh3_128" in found["__0_0.distcp"]
    assert damaged_share(tmp_path, {"files": files}, ["__0_0.distcp"], 1, 2) == {}  # not its share
    listings = [(0, _listing(6, files=files)), (1, _listing(6, files=files))]
    drop_damaged(listings, 6, [(0, found)])
    step, commit, holders = snapshot_io.choose(listings, KEY)
    assert step == 6 and holders["__0_0.distcp"] == [1]
    assert ("__0_0.distcp", 2, 0) in snapshot_io.transfers(holders, {0: 0, 1: 2})
    drop_damaged(listings, 6, [(1, found)])
    step, problems = snapshot_io.choose(listings, KEY, {(6, "__0_0.distcp"): "is damaged on node 0 (x)"})
    assert step is None and problems[0].startswith("step_00000006/__0_0.distcp is damaged on node 0")
