"""Parquet inputs under pressure (issue #47): a huge row is read in bounded batches within the
memory bound of docs/data.md, memory running out is one `error:` line naming the file, a
dictionary-encoded (categorical) text column is text, and a row that is not UTF-8 or a corrupt
row group is named (the everyday cases: test_data_shard.py)."""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest

from data_tools.__main__ import main
from data_tools.corpora import shakespeare_files
from tests.conftest import ROOT

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROW_BYTES = 30_000_000
# the shard command, reporting its own resident and address-space peaks (VmHWM, VmPeak) at exit;
# not its "peak memory" line: a forked child's ru_maxrss starts from its parent's (pytest's) RSS
SHARD = ("import atexit, sys\n"
         "def peaks():\n"
         "    for line in open('/proc/self/status'):\n"
         "        if line.startswith(('VmHWM', 'VmPeak')):\n"
         "            print('PEAK', line.split()[0], line.split()[1], file=sys.stderr)\n"
         "atexit.register(peaks)\n"
         "from data_tools.__main__ import main\n"
         "sys.exit(main(['shard', '--tokenizer', 'bytes', '--no-progress'] + sys.argv[1:]))\n")


def _plays() -> str:
    return "".join(open(f, encoding="utf-8").read() for f in shakespeare_files())


def _shard(src, out, address_space_mb: int | None = None):
    """(exit status, {'VmHWM': MiB, 'VmPeak': MiB}, stderr lines other than the peaks)."""
    limit = None if address_space_mb is None else address_space_mb << 20
    r = subprocess.run([sys.executable, "-c", SHARD, "--input", str(src), "--output", str(out)],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=120, preexec_fn=None if limit is None else
                       lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    peaks = {m[0]: int(m[1]) >> 10 for m in re.findall(r"^PEAK (\w+): (\d+)$", r.stderr, re.M)}
    return r.returncode, peaks, [ln for ln in r.stderr.splitlines()
                                 if ln.strip() and not ln.startswith("PEAK ")]


@pytest.fixture(scope="module")
def one_huge_row(tmp_path_factory):
    """A 30 MB row of real text (the plays repeated) and a 100 kB one, each a Parquet file."""
    d = tmp_path_factory.mktemp("rows")
    plays = _plays()
    text = (plays * (ROW_BYTES // len(plays) + 1))[:ROW_BYTES]
    pq.write_table(pa.table({"text": [text]}), str(d / "huge.parquet"))
    pq.write_table(pa.table({"text": [plays[:100_000]]}), str(d / "small.parquet"))
    return d


def test_a_huge_row_costs_under_five_times_its_text(one_huge_row, tmp_path):
    """Was 14 x (413 MB more than a small row for 30 MB: a row group's Python list, int64 ids, a
    second copy of the tokens); 3.8 x now (114 MB): its Arrow batch alone, then text + tokens."""
    rc, small, err = _shard(one_huge_row / "small.parquet", tmp_path / "small")
    assert rc == 0, err
    rc, huge, err = _shard(one_huge_row / "huge.parquet", tmp_path / "huge")
    assert rc == 0, err
    grew_mb = huge["VmHWM"] - small["VmHWM"]
    assert grew_mb < 5 * ROW_BYTES / 2 ** 20, (small, huge)
    from data_tools.format import read_manifest

    assert read_manifest(str(tmp_path / "huge"))["n_tokens"]["train"] == ROW_BYTES + 1


def test_memory_running_out_is_one_error_line_naming_the_file(one_huge_row, tmp_path):
    """Under an address-space limit just above what a small row needs (`ulimit -v`)."""
    rc, small, err = _shard(one_huge_row / "small.parquet", tmp_path / "small")
    assert rc == 0, err
    rc, _, err = _shard(one_huge_row / "huge.parquet", tmp_path / "huge", small["VmPeak"] + 10)
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("error: ") and "huge.parquet" in err[0] and "memory" in err[0], err
    assert not os.path.exists(tmp_path / "huge")  # nothing left behind, not even the staging
    assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


def _tokens(out) -> np.ndarray:
    import h5py

    with h5py.File(os.path.join(out, "train_00000.h5"), "r") as f:
        return f["tokens"][:]


def test_a_dictionary_encoded_column_is_read_as_text(tmp_path, capsys):
    """What pandas writes for a categorical column: the same tokens as the plain strings."""
    plays = [open(f, encoding="utf-8").read()[:20_000] for f in shakespeare_files()[:5]]
    texts = plays + plays[:3]  # repeated values, as a categorical holds them
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}),
                   str(tmp_path / "cat.parquet"), row_group_size=3)
    pq.write_table(pa.table({"text": pa.array(texts, pa.large_string())}),
                   str(tmp_path / "plain.parquet"), row_group_size=3)
    assert pq.ParquetFile(str(tmp_path / "cat.parquet")).schema_arrow.field("text").type == \
        pa.dictionary(pa.int32(), pa.string())
    for name in ("cat", "plain"):
        assert main(["shard", "--input", str(tmp_path / f"{name}.parquet"), "--output",
                     str(tmp_path / name), "--tokenizer", "bytes", "--val-fraction", "0",
                     "--no-progress"]) == 0, capsys.readouterr().err
    cat = _tokens(tmp_path / "cat")
    assert np.array_equal(cat, _tokens(tmp_path / "plain"))
    assert bytes(cat[cat != 256].astype(np.uint8)).decode() == "".join(texts)


def test_a_row_not_utf8_and_a_corrupt_row_group_are_named(tmp_path, capsys):
    data = "good text".encode() + b"\xff\xfe bad"
    offsets = pa.py_buffer(np.array([0, 9, len(data)], np.int32).tobytes())
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), 2, [None, offsets,
                                                                             pa.py_buffer(data)])}),
                   str(tmp_path / "bad.parquet"))  # Arrow checks no UTF-8 when it reads Parquet
    args = ["--input", str(tmp_path / "bad.parquet")]
    assert main(["shard", *args, "--output", str(tmp_path / "o"), "--tokenizer", "bytes",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'bad.parquet'} row 1: "), err
    assert main(["validate", *args]) == 0  # validate counts it invalid, like a text file's
    assert "dropped 1" in capsys.readouterr().out
    plays = [open(f, encoding="utf-8").read() for f in shakespeare_files()[:4]]
    path = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"text": plays}), str(path), row_group_size=2)
    raw = bytearray(path.read_bytes())
    raw[2000:6000] = bytes(b ^ 0x5A for b in raw[2000:6000])  # inside row group 0's pages
    path.write_bytes(bytes(raw))
    assert main(["shard", "--input", str(path), "--output", str(tmp_path / "o"), "--tokenizer",
                 "bytes", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path} row group 0: "), err
