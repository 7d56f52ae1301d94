"""Shard format + manifest: round trips, determinism, one-line DataErrors naming the path."""
import hashlib
import json
import os

import h5py
import numpy as np
import pytest

from data_tools.format import (FORMAT_VERSION, DataError, open_shard_layout, read_manifest,
                               shard_filename, token_dtype, write_manifest, write_shard)

META = dict(split="train", tokenizer="bytes", vocab_size=257, eot_id=256)


def _manifest(entries):
    return {"format_version": FORMAT_VERSION,
            "tokenizer": {"name": "bytes", "vocab_size": 257, "eot_id": 256},
            "dtype": "uint16", "seed": 7, "val_fraction": 0.0, "shard_tokens": 1000,
            "n_documents": {"train": 2, "val": 0},
            "n_tokens": {"train": sum(e["n_tokens"] for e in entries), "val": 0},
            "shards": entries}


def test_names_and_dtype():
    assert shard_filename("train", 3) == "train_00003.h5"
    assert shard_filename("val", 123456) == "val_123456.h5"
    assert token_dtype(257) == np.uint16 and token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(ValueError):
        shard_filename("test", 0)


def test_shard_write_is_deterministic_and_contiguous(tmp_path):
    toks = np.arange(1000, dtype=np.int64) % 257
    a = write_shard(str(tmp_path / "train_00000.h5"), toks, [0, 10], **META)
    os.rename(tmp_path / "train_00000.h5", tmp_path / "first.h5")
    b = write_shard(str(tmp_path / "train_00000.h5"), toks, [0, 10], **META)
    assert a == b and a["n_tokens"] == 1000 and a["n_docs"] == 2
    raw = (tmp_path / "train_00000.h5").read_bytes()
    assert raw == (tmp_path / "first.h5").read_bytes()
    assert a["sha256"] == hashlib.sha256(raw).hexdigest() and a["bytes"] == len(raw)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    with h5py.File(tmp_path / "train_00000.h5", "r") as f:
        d = f["tokens"]
        assert d.dtype == np.uint16 and d.chunks is None and d.compression is None
        assert d.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        assert f["doc_offsets"][()].tolist() == [0, 10]
        assert {k: (v if isinstance(v, str) else int(v)) for k, v in f.attrs.items()} == {
            "format_version": 1, "tokenizer": "bytes", "vocab_size": 257, "eot_id": 256,
            "n_tokens": 1000, "split": "train"}
        off = d.id.get_offset()
    mm = np.memmap(tmp_path / "train_00000.h5", dtype=np.uint16, mode="r", offset=off, shape=(1000,))
    assert np.array_equal(mm, toks)


def test_manifest_round_trip_and_layout(tmp_path):
    e = write_shard(str(tmp_path / "train_00000.h5"), np.full(50, 256), [0, 3, 49], **META)
    m = _manifest([e])
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)) == m
    text = (tmp_path / "manifest.json").read_text()
    assert text == json.dumps(m, indent=2, sort_keys=True) + "\n"
    lay = open_shard_layout(str(tmp_path / "train_00000.h5"), e, m)
    assert lay.n_tokens == 50 and lay.dtype == np.uint16 and lay.doc_offsets.tolist() == [0, 3, 49]
    # attrs inconsistent with the manifest are reported against the shard file
    bad = dict(m, tokenizer={"name": "gpt2", "vocab_size": 257, "eot_id": 256})
    with pytest.raises(DataError, match=r"^.*train_00000\.h5: attribute tokenizer='bytes'"):
        open_shard_layout(str(tmp_path / "train_00000.h5"), e, bad)


def test_read_manifest_errors(tmp_path):
    with pytest.raises(DataError) as ei:
        read_manifest(str(tmp_path))
    msg = str(ei.value)
    assert msg.startswith(str(tmp_path / "manifest.json") + ": missing") and "\n" not in msg
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DataError, match="format_version 99 unsupported"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable"):
        read_manifest(str(tmp_path))


def test_data_error_is_one_line():
    e = DataError("some/file.h5", "bad\nthing")
    assert str(e) == "some/file.h5: bad thing" and e.path == "some/file.h5"
