"""The sharder (single process): document order, split rule, shard cutting, safety, CLI."""
import json
import os
import re

import h5py
import numpy as np
import pytest

from data_tools.__main__ import main
from data_tools.corpora import shakespeare_dir, shakespeare_files
from data_tools.documents import assign_val, balanced_ranges, enumerate_documents
from data_tools.format import DataError, read_manifest
from data_tools.shard import shard_dataset
from data_tools.tokenizers import get_tokenizer
from data_tools.verify import verify_dataset

QUIET = dict(progress=False, log=lambda msg: None)


def stream(root, split):
    """(concatenated tokens, global doc starts) of a split, read back with h5py."""
    m = read_manifest(str(root))
    toks, starts, base = [], [], 0
    for s in m["shards"]:
        if s["split"] != split:
            continue
        with h5py.File(os.path.join(root, s["file"]), "r") as f:
            toks.append(f["tokens"][()])
            starts.extend((f["doc_offsets"][()] + base).tolist())
        base += toks[-1].size
    return (np.concatenate(toks) if toks else np.zeros(0, np.uint16)), starts


@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second document, in b.txt\n")
    (d / "a.md").write_text("# first\nby sorted relative path\n")
    (d / "sub" / "c.jsonl").write_text(
        json.dumps({"text": "third (jsonl line 1)"}) + "\n\n"
        + json.dumps({"text": "fourth — jsonl line 3", "id": 4}) + "\n")
    (d / "sub" / "z.rst").write_text("fifth " * 40)
    (d / ".hidden.txt").write_text("skipped: hidden")
    (d / "notes.csv").write_text("skipped: suffix")
    extra = tmp_path / "extra.dat"
    extra.write_text("sixth, an explicit file of any suffix")
    docs = ["# first\nby sorted relative path\n", "second document, in b.txt\n",
            "third (jsonl line 1)", "fourth — jsonl line 3", "fifth " * 40,
            "sixth, an explicit file of any suffix"]
    return [str(d), str(extra)], docs


def test_document_order_and_stream_content(tmp_path, corpus):
    inputs, docs = corpus
    table = enumerate_documents(inputs)
    assert len(table) == 6 and table.line.tolist() == [0, 0, 1, 3, 0, 0]
    out = tmp_path / "ds"
    m = shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=64, val_fraction=0.0,
                      seed=0, **QUIET)
    tok = get_tokenizer("bytes")
    want = [np.append(tok.encode(t), 256) for t in docs]
    toks, starts = stream(out, "train")
    assert np.array_equal(toks, np.concatenate(want))
    assert starts == np.cumsum([0] + [w.size for w in want[:-1]]).tolist()
    sizes = [s["n_tokens"] for s in m["shards"]]
    assert all(n == 64 for n in sizes[:-1]) and 0 < sizes[-1] <= 64 and sum(sizes) == toks.size
    assert m["n_documents"] == {"train": 6, "val": 0} and m["n_tokens"]["val"] == 0
    assert verify_dataset(str(out)) == []


def test_split_assignment_and_val_stream(tmp_path):
    docs = [f"document number {i} " * (1 + i % 5) for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "ds"
    m = shard_dataset([str(path)], str(out), tokenizer="bytes", shard_tokens=100,
                      val_fraction=0.25, seed=3, **QUIET)
    is_val = assign_val(40, 0.25, 3)
    assert m["n_documents"] == {"train": int((~is_val).sum()), "val": int(is_val.sum())}
    tok = get_tokenizer("bytes")
    for split, mask in (("train", ~is_val), ("val", is_val)):
        want = np.concatenate([np.append(tok.encode(docs[i]), 256) for i in np.flatnonzero(mask)])
        assert np.array_equal(stream(out, split)[0], want)
    assert verify_dataset(str(out)) == []


def test_split_rule_properties():
    a = assign_val(10_000, 0.1, seed=1)
    assert np.array_equal(a, assign_val(10_000, 0.1, seed=1))
    assert not np.array_equal(a, assign_val(10_000, 0.1, seed=2))
    assert 0.09 < a.mean() < 0.11
    assert np.array_equal(assign_val(50, 0.1, 1), a[:50])  # a prefix keeps its assignment
    assert assign_val(2, 1e-9, 0).sum() == 1  # >= 1 val document when val_fraction > 0
    assert assign_val(3, 0.999, 0).sum() == 2  # >= 1 train document
    assert assign_val(1, 0.5, 0).tolist() == [False] and not assign_val(9, 0.0, 0).any()
    with pytest.raises(ValueError):
        assign_val(5, 1.0, 0)


def test_balanced_ranges_cover_everything():
    length = np.array([5, 1, 1, 1, 100, 3, 3], dtype=np.int64)
    for n in (1, 2, 3, 8):
        r = balanced_ranges(length, n)
        assert len(r) == n and r[0][0] == 0 and r[-1][1] == 7
        assert all(r[i][1] == r[i + 1][0] and r[i][0] <= r[i][1] for i in range(n - 1))


def test_jsonl_without_text_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError) as ei:
        shard_dataset([str(p)], str(tmp_path / "ds"), tokenizer="bytes", **QUIET)
    assert str(ei.value).startswith(f"{p}:2: ") and "text" in str(ei.value)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_missing_input_and_undecodable_text(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: no such file"):
        shard_dataset([str(tmp_path / "nope.txt")], str(tmp_path / "ds"), tokenizer="bytes", **QUIET)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8 \(byte 3\)"):
        shard_dataset([str(bad)], str(tmp_path / "ds"), tokenizer="bytes", **QUIET)


def test_refuses_foreign_dir_and_replaces_own_dataset(tmp_path, corpus):
    inputs, _ = corpus
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        shard_dataset(inputs, str(foreign), tokenizer="bytes", **QUIET)
    assert (foreign / "precious.txt").read_text() == "keep me"
    out = tmp_path / "ds"
    m1 = shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=32, val_fraction=0,
                       **QUIET)
    m2 = shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=1000, val_fraction=0,
                       **QUIET)
    assert len(m1["shards"]) > 5 and len(m2["shards"]) == 1
    assert sorted(os.listdir(out)) == ["manifest.json", "train_00000.h5"]
    assert verify_dataset(str(out)) == []


def test_cli_shakespeare_gpt2(tmp_path, capsys):
    plays = [os.path.join(shakespeare_dir(), f) for f in ("macbeth_gut.txt", "hamlet_gut.txt")]
    out = tmp_path / "ds"
    rc = main(["shard", "--input", *plays, "--output", str(out), "--tokenizer", "gpt2",
               "--shard-tokens", "20000", "--val-fraction", "0.5", "--seed", "0", "--no-progress"])
    assert rc == 0 and "tokens/s" in capsys.readouterr().out
    m = read_manifest(str(out))
    assert m["n_documents"] == {"train": 1, "val": 1} and m["dtype"] == "uint16"
    tok = get_tokenizer("gpt2")
    split_of = {False: "train", True: "val"}
    for i, path in enumerate(plays):
        text = open(path, encoding="utf-8").read()
        toks, starts = stream(out, split_of[bool(assign_val(2, 0.5, 0)[i])])
        assert starts == [0] and np.array_equal(toks, np.append(tok.encode(text), 50256))
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: OK")
    assert main(["inspect", str(out)]) == 0
    assert "tokenizer gpt2 (vocab_size 50257" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path}/manifest.json: missing")


def test_cli_help_explains_options(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["shard", "--help"])
    assert ei.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--input", "--output", "--tokenizer", "--shard-tokens", "--val-fraction", "--seed"):
        assert opt in text


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("bad", ["misspelled", "latin1", "empty_input_dir"])
def test_failed_rewrite_leaves_the_old_dataset_byte_for_byte(tmp_path, corpus, bad):
    """The new dataset is built beside --output and swapped in only when complete: a failure at
    any point before that leaves the old shards and manifest as they were, and no staging folder."""
    inputs, _ = corpus
    out = tmp_path / "ds"
    shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=32, val_fraction=0, **QUIET)
    before, siblings = _tree(out), sorted(os.listdir(tmp_path))
    assert len(before) > 3
    src = tmp_path / bad
    if bad == "latin1":
        src.write_bytes("caf\xe9".encode("latin-1"))
    elif bad == "empty_input_dir":
        src.mkdir()
    with pytest.raises(DataError, match=bad):
        shard_dataset([inputs[0], str(src)], str(out), tokenizer="bytes", **QUIET)
    assert _tree(out) == before
    assert sorted(set(os.listdir(tmp_path)) - {bad}) == siblings  # no staging folder left


def test_shard_files_without_a_manifest_are_refused_not_emptied(tmp_path, corpus):
    inputs, _ = corpus
    out = tmp_path / "orphans"
    siblings = sorted(os.listdir(tmp_path) + ["orphans"])
    out.mkdir()
    (out / "train_00000.h5").write_bytes(b"somebody's only copy")
    with pytest.raises(DataError, match=r"orphans: holds shard files .* but no manifest\.json"):
        shard_dataset(inputs, str(out), tokenizer="bytes", **QUIET)
    assert (out / "train_00000.h5").read_bytes() == b"somebody's only copy"
    assert sorted(os.listdir(tmp_path)) == siblings


def test_interrupted_write_never_touches_the_old_dataset(tmp_path, corpus, monkeypatch):
    """A failure while the new shards are written (a full disk, a kill): old dataset intact."""
    import data_tools.shard as shard_mod

    inputs, _ = corpus
    out = tmp_path / "ds"
    shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=32, val_fraction=0, **QUIET)
    before, siblings = _tree(out), sorted(os.listdir(tmp_path))
    calls = []

    def full_disk(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        return real_write(path, *a, **k)

    real_write = shard_mod.write_shard
    monkeypatch.setattr(shard_mod, "write_shard", full_disk)
    with pytest.raises(OSError):
        shard_dataset(inputs, str(out), tokenizer="bytes", shard_tokens=16, val_fraction=0, **QUIET)
    assert calls and all(".ds.hpctrain-partial" in c for c in calls)
    assert _tree(out) == before
    assert sorted(os.listdir(tmp_path)) == siblings


# ---- two runs onto one --output (#30) ---------------------------------------------------------
def _shard_proc(inputs, out, tokenizer="bytes"):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "data_tools", "shard", "--input", *map(str, inputs),
                             "--output", str(out), "--tokenizer", tokenizer, "--shard-tokens",
                             "200000", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _when_staging_appears(proc, out):
    import time

    stage = out.parent / f".{out.name}.hpctrain-partial"
    while not stage.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    return stage


def _refused_or_ok(proc, out) -> int:
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if proc.returncode:  # refused: one line naming the output and the holder's pid
        assert len(lines) == 1 and lines[0].startswith(f"error: {out}: another run is writing"), err
        assert "Traceback" not in err and re.search(r"pid \d+ on ", lines[0]), err
    return proc.returncode


def test_second_run_onto_a_busy_output_is_refused_and_changes_nothing(tmp_path):
    """Run A is frozen (SIGSTOP) mid-run holding the output's lock: run B onto the same output is
    refused in one line, A's staging folder survives, A then finishes and its dataset verifies."""
    import signal

    plays = sorted(shakespeare_files())[:6]
    out = tmp_path / "ds"
    a = _shard_proc(plays, out)
    stage = _when_staging_appears(a, out)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = _shard_proc(plays, out)
        assert _refused_or_ok(b, out) == 1
        assert stage.is_dir() and not out.exists()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert _refused_or_ok(a, out) == 0
    assert verify_dataset(str(out)) == []
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # no staging folder, no lock file


@pytest.mark.parametrize("gap_s", [0.05, 0.3])
def test_racing_runs_never_leave_a_damaged_dataset(tmp_path, gap_s):
    """Two runs onto one output started `gap_s` apart: each either succeeds or is refused in one
    line, at least one succeeds, and the dataset verifies (checksums)."""
    import time

    plays = sorted(shakespeare_files())[:6]
    out = tmp_path / "ds"
    a = _shard_proc(plays, out)
    time.sleep(gap_s)
    b = _shard_proc(plays, out)
    codes = [_refused_or_ok(a, out), _refused_or_ok(b, out)]
    assert 0 in codes and set(codes) <= {0, 1}, codes
    assert verify_dataset(str(out)) == []
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_blend_onto_a_locked_output_is_refused(tmp_path, corpus, capsys):
    from data_tools.output_lock import OutputLock

    inputs, _ = corpus
    src = tmp_path / "src"
    shard_dataset(inputs, str(src), tokenizer="bytes", **QUIET)
    out = tmp_path / "mix"
    with OutputLock(str(out)):
        assert main(["blend", "--input", f"{src}:1", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: another run is writing") and f"pid {os.getpid()} " in err
    assert err.count("\n") == 1 and not out.exists()
    assert main(["blend", "--input", f"{src}:1", "--output", str(out)]) == 0
    assert not [n for n in os.listdir(tmp_path) if "hpctrain-lock" in n]


def test_ctrl_c_is_one_line_and_leaves_nothing(tmp_path):
    """SIGINT to a single-process shard mid-run: exit 130, one `error: interrupted` line, no
    traceback, no --output, no partial folder, no lock file."""
    import signal

    out = tmp_path / "ds"
    proc = _shard_proc(sorted(shakespeare_files())[:6], out, tokenizer="gpt2")
    _when_staging_appears(proc, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (SIGINT)"), err
    assert os.listdir(tmp_path) == []


def _write_parquet(path, texts, column="text", row_group_size=2):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(texts))), column: texts})
    pq.write_table(table, str(path), row_group_size=row_group_size)


def test_parquet_input_rows_are_documents(tmp_path, capsys):
    """#32: FineWeb-style Parquet (a text column, several row groups) beside a text file."""
    texts = ["first row", "zweite Zeile ü", "third", "fourth row", "fifth"]
    d = tmp_path / "dump"
    d.mkdir()
    _write_parquet(d / "part-0.parquet", texts[:3])
    _write_parquet(d / "part-1.parquet", texts[3:], column="content")
    assert main(["shard", "--input", str(d / "part-0.parquet"), "--output", str(tmp_path / "a"),
                 "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress"]) == 0
    toks, starts = stream(tmp_path / "a", "train")
    assert bytes(toks[toks != 256].astype(np.uint8)).decode() == "".join(texts[:3])
    assert starts == [0, 10, 26] and read_manifest(str(tmp_path / "a"))["n_documents"]["train"] == 3
    capsys.readouterr()
    assert main(["shard", "--input", str(d), "--output", str(tmp_path / "b"), "--tokenizer", "bytes",
                 "--no-progress"]) == 1  # part-1 has no "text" column: one line naming it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "part-1.parquet" in err[0] and "--text-column" in err[0]
    assert main(["shard", "--input", str(d / "part-1.parquet"), "--output", str(tmp_path / "c"),
                 "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress",
                 "--text-column", "content", "--filter"]) == 0
    toks, _ = stream(tmp_path / "c", "train")
    assert bytes(toks[toks != 256].astype(np.uint8)).decode() == "".join(texts[3:])
    assert main(["train-tokenizer", "--input", str(d / "part-1.parquet"), "--text-column", "content",
                 "--output", str(tmp_path / "tok"), "--vocab-size", "300"]) == 0
    assert "trained on 2 documents" in capsys.readouterr().out


def test_parquet_without_pyarrow_is_one_line(tmp_path):
    import subprocess
    import sys

    _write_parquet(tmp_path / "x.parquet", ["a"])
    block = tmp_path / "block" / "pyarrow"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('no pyarrow here')\n")
    env = dict(os.environ, PYTHONPATH=f"{block.parent}{os.pathsep}{os.getcwd()}")
    r = subprocess.run([sys.executable, "-m", "data_tools", "shard", "--input", str(tmp_path / "x.parquet"),
                        "--output", str(tmp_path / "o"), "--tokenizer", "bytes", "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "x.parquet" in lines[0] and "pip install 'hpctrain[parquet]'" in lines[0]


def test_extensions_pick_files_from_directories(tmp_path, capsys):
    """#32: a directory of .py files was refused; --extensions .py,.txt takes them (sorted)."""
    d = tmp_path / "repo"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "b.py").write_text("print(2)\n")
    (d / "a.py").write_text("x = 1\n")
    (d / "notes.txt").write_text("hi")
    (d / "data.csv").write_text("1,2")
    assert main(["shard", "--input", str(d / "pkg"), "--output", str(tmp_path / "o"),
                 "--tokenizer", "bytes", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pkg" in err[0] and "--extensions" in err[0]
    assert main(["shard", "--input", str(d), "--output", str(tmp_path / "o"), "--tokenizer", "bytes",
                 "--no-progress", "--val-fraction", "0", "--extensions", ".py,txt"]) == 0
    toks, starts = stream(tmp_path / "o", "train")
    assert bytes(toks[toks != 256].astype(np.uint8)).decode() == "x = 1\nhiprint(2)\n"
    assert len(starts) == 3  # a.py, notes.txt, pkg/b.py; data.csv left out
    capsys.readouterr()
    assert main(["validate", "--input", str(d / "pkg"), "--extensions", ".py"]) == 0
    assert capsys.readouterr().out.startswith("1 documents: kept 1")
