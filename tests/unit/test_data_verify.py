"""verify: each kind of damage is caught with ONE line naming the file; verify is read-only."""
import hashlib
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from data_tools.__main__ import main
from data_tools.corpora import shakespeare_dir
from data_tools.format import manifest_path, read_manifest, sha256_file
from data_tools.shard import shard_dataset
from data_tools.verify import verify_dataset


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine") / "ds"
    plays = [os.path.join(shakespeare_dir(), f) for f in ("macbeth_gut.txt", "julius_caesar_gut.txt",
                                                          "tempest_gut.txt")]
    shard_dataset(plays, str(out), tokenizer="gpt2", shard_tokens=30_000, val_fraction=0.3,
                  seed=1, progress=False, log=lambda m: None)
    return out


@pytest.fixture()
def ds(pristine, tmp_path):
    dst = tmp_path / "ds"
    shutil.copytree(pristine, dst)
    return dst


def digests(root):
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in sorted(os.listdir(root))}


def check_one_line(ds, capsys, expect_prefix, expect_text):
    before = digests(ds)
    problems = verify_dataset(str(ds))
    assert problems and problems[0].startswith(expect_prefix) and expect_text in problems[0]
    assert all("\n" not in p for p in problems)
    assert main(["verify", str(ds)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {expect_prefix}") and expect_text in err
    assert digests(ds) == before  # verify never modifies anything
    return problems[0]


def test_pristine_ok_and_read_only(ds, capsys):
    before = digests(ds)
    assert verify_dataset(str(ds)) == []
    m = read_manifest(str(ds))
    assert len(m["shards"]) >= 4
    # the trainer can spread shard checks over ranks
    n = len(m["shards"])
    assert verify_dataset(str(ds), shard_indices=range(0, n, 2)) == []
    assert verify_dataset(str(ds), shard_indices=[n]) != []
    assert main(["verify", str(ds)]) == 0 and "OK" in capsys.readouterr().out
    assert digests(ds) == before


def test_truncated_shard(ds, capsys):
    p = ds / "train_00001.h5"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    check_one_line(ds, capsys, f"{p}: truncated", f"({size - 100} bytes, manifest says {size})")


def test_flipped_byte_sha256(ds, capsys):
    p = ds / "train_00000.h5"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    want = read_manifest(str(ds))["shards"][0]["sha256"]
    line = check_one_line(ds, capsys, f"{p}: sha256 mismatch", f"manifest {want[:12]}")
    assert sha256_file(str(p))[:12] in line


def test_token_out_of_range_caught_by_range_check(ds, capsys):
    p = ds / "val_00000.h5"
    with h5py.File(p, "r") as f:
        off = f["tokens"].id.get_offset()
    mm = np.memmap(p, dtype=np.uint16, mode="r+", offset=off, shape=(100,))
    mm[42] = 60000  # >= vocab_size 50257, still fits uint16
    mm.flush()
    del mm
    m = json.loads((ds / "manifest.json").read_text())
    for s in m["shards"]:  # recompute the checksum so ONLY the range check can catch it
        if s["file"] == p.name:
            s["sha256"] = sha256_file(str(p))
    (ds / "manifest.json").write_text(json.dumps(m))
    check_one_line(ds, capsys, f"{p}: token id 60000 at position 42", ">= vocab_size 50257")


def test_missing_manifest(ds, capsys):
    os.unlink(manifest_path(str(ds)))
    check_one_line(ds, capsys, f"{ds}/manifest.json: missing", "incomplete shard run")


def test_missing_shard(ds, capsys):
    os.unlink(ds / "train_00002.h5")
    check_one_line(ds, capsys, f"{ds / 'train_00002.h5'}: missing", "listed in manifest")


def test_manifest_totals_inconsistent(ds, capsys):
    m = json.loads((ds / "manifest.json").read_text())
    m["n_documents"]["val"] += 1
    (ds / "manifest.json").write_text(json.dumps(m))
    check_one_line(ds, capsys, f"{ds}/manifest.json: n_documents[val]", "shards begin")


def test_no_checksums_mode_skips_full_passes_only(ds, capsys):
    p = ds / "train_00000.h5"
    with h5py.File(p, "r") as f:
        off = f["tokens"].id.get_offset()
    data = bytearray(p.read_bytes())
    data[off + 1001] ^= 0x01  # inside the token payload: only sha256 / range scan could see it
    p.write_bytes(bytes(data))
    assert verify_dataset(str(ds), checksums=False) == []
    assert main(["verify", "--no-checksums", str(ds)]) == 0
    assert "checksums skipped" in capsys.readouterr().out
    assert verify_dataset(str(ds))[0].startswith(f"{p}: sha256 mismatch")
    os.unlink(ds / "val_00000.h5")
    assert verify_dataset(str(ds), checksums=False)[-1].startswith(f"{ds / 'val_00000.h5'}: missing")
