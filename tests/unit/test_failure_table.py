"""Every failure a user can cause ends with one line naming the file, exit status != 0, no
traceback, nothing that existed before is changed and nothing half-written is left (#16, #47).
Table-driven: each row sets up a fault, runs a real command (`python -m data_tools ...`,
`python -m hpctrain ...`) and the checks are the same for all rows. Full and read-only disks are
real tmpfs mounts (root only; skipped elsewhere, with the reason).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_TRAIN, checksums, run_cmd


@pytest.fixture(scope="module")
def dataset(one_play):
    return one_play


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def truncated_shard(tmp, ds, mounts):
    d = _copy(ds, tmp / "trunc")
    shard = d / "train_00000.h5"
    shard.write_bytes(shard.read_bytes()[:1000])
    return ["data_tools", "stats", d], d, str(shard)


def deleted_shard(tmp, ds, mounts):
    d = _copy(ds, tmp / "gone")
    (d / "train_00001.h5").unlink()
    return ["data_tools", "stats", d], d, str(d / "train_00001.h5")


def misspelled_input_over_a_dataset(tmp, ds, mounts):
    d = _copy(ds, tmp / "keep")
    return (["data_tools", "shard", "--input", tmp / "plays.txtt", "--output", d, "--tokenizer",
             "bytes", "--no-progress"], d, "plays.txtt")


def shard_onto_a_full_disk(tmp, ds, mounts):
    from data_tools.corpora import shakespeare_files

    disk = mounts.tmpfs(tmp / "small", "64k")
    return (["data_tools", "shard", "--input", sorted(shakespeare_files())[0], "--output",
             disk / "ds", "--tokenizer", "bytes", "--no-progress"], disk, str(disk))


def shard_onto_a_read_only_disk(tmp, ds, mounts):
    from data_tools.corpora import shakespeare_files

    disk = mounts.tmpfs(tmp / "ro", "1m", readonly=True)
    return (["data_tools", "shard", "--input", sorted(shakespeare_files())[0], "--output",
             disk / "ds", "--tokenizer", "bytes", "--no-progress"], disk, str(disk))


def train_into_a_read_only_run_dir(tmp, ds, mounts):
    disk = mounts.tmpfs(tmp / "ro-run", "1m", readonly=True)
    cfg = tmp / "ro.toml"
    cfg.write_text(TINY_TRAIN.format(run=disk / "run", data=ds, steps=2))
    return ["hpctrain", "train", "--config", cfg], disk, str(disk / "run")


def train_onto_a_full_disk(tmp, ds, mounts):
    disk = mounts.tmpfs(tmp / "full-run", "16k")
    cfg = tmp / "full.toml"
    cfg.write_text(TINY_TRAIN.format(run=disk / "run", data=ds, steps=2))
    return ["hpctrain", "train", "--config", cfg], tmp / "full-run-before", str(disk / "run")


def export_onto_a_full_disk(tmp, ds, mounts):
    """A 200 KB weight file onto 64 KB: one line naming the output, no partial folder left."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpctrain.checkpoint import CheckpointManager
    from hpctrain.model import build_model_from_section

    section = {"n_layer": 1, "n_head": 2, "n_embd": 64, "block_size": 32, "vocab_size": 257}
    msd, _ = get_state_dict(build_model_from_section(section), [])
    CheckpointManager(tmp / "run" / "checkpoints", keep=1, rank=0, world_size=1).save(
        1, {"model": msd}, {"step": 1, "config": {"model": section, "data": {"path": str(ds)}},
                            "tokenizer": {"name": "bytes", "eot_id": 256, "vocab_size": 257}})
    disk = mounts.tmpfs(tmp / "small-out", "64k")
    return (["hpctrain", "export", "--checkpoint", tmp / "run", "--output", disk / "hf"], disk,
            str(disk / "hf"))


def verify_a_missing_checkpoint(tmp, ds, mounts):
    return ["hpctrain", "ckpt", "verify", tmp / "no-such-run"], ds, str(tmp / "no-such-run")


def tune_status_given_a_training_config(tmp, ds, mounts):
    d = tmp / "configs"
    d.mkdir()
    (d / "tune.toml").write_text(TINY_TRAIN.format(run=tmp / "run", data=ds, steps=2))
    return ["hpctrain", "tune", "status", d / "tune.toml"], d, str(d / "tune.toml")


def train_through_the_node_cache_from_corrupt_shards(tmp, ds, mounts):
    d = _copy(ds, tmp / "rot")
    for shard in d.glob("train_*.h5"):  # one flipped bit each: caught as the leader stages it
        data = bytearray(shard.read_bytes())
        data[-50] ^= 1
        shard.write_bytes(bytes(data))
    cfg = tmp / "rot.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp / "run", data=d, steps=2))
    return (["hpctrain", "train", "--config", cfg, f"--data.cache_dir={tmp / 'cache'}"], d,
            f"{d}/train_0")


ROWS = [truncated_shard, deleted_shard, misspelled_input_over_a_dataset, shard_onto_a_full_disk,
        shard_onto_a_read_only_disk, train_into_a_read_only_run_dir, train_onto_a_full_disk,
        export_onto_a_full_disk, verify_a_missing_checkpoint, tune_status_given_a_training_config,
        train_through_the_node_cache_from_corrupt_shards]


@pytest.mark.parametrize("row", ROWS, ids=[r.__name__ for r in ROWS])
def test_failure_is_one_line_naming_the_file_and_changes_nothing(tmp_path, dataset, mounts, row):
    args, watched, named = row(tmp_path, dataset, mounts)
    watched.mkdir(parents=True, exist_ok=True)
    before, entries = checksums(watched), sorted(p.name for p in watched.iterdir())
    r = run_cmd([sys.executable, "-m", *map(str, args)], timeout=180)
    if args[0] == "hpctrain":  # its stderr also carries the training log: the error lines
        lines = [l for l in r.stderr.splitlines() if re.match(r"(\[rank \d+\] )?error: ", l)]
    else:  # data_tools prints nothing else on stderr
        lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("warning:")]
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and named in lines[0], r.stderr
    assert checksums(watched) == before
    assert sorted(p.name for p in watched.iterdir()) == entries  # no folder left half written
    assert not [p for p in watched.parent.iterdir() if p.name.endswith(".hpctrain-partial")]
