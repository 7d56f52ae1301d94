"""Every user-facing failure of `python -m data_tools CMD` is ONE stderr line starting `error:` and
naming the file, key or argument, with exit status != 0 and no traceback (issue #47: DataError
lines had no `error:`, a manifest nested 100,000 deep was a RecursionError traceback, argparse's
errors were a usage block). Several bad inputs per subcommand; the specific messages are tested
where each check lives (test_data_shard.py, test_data_blend.py, test_data_verify.py, ...)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data_tools.__main__ import main
from data_tools.corpora import shakespeare_files
from tests.conftest import ROOT

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad inputs beside one good dataset (a play, bytes tokenizer) and its truncated copy."""
    d = tmp_path_factory.mktemp("bad")
    play = sorted(shakespeare_files())[0]
    assert main(["shard", "--input", play, "--output", str(d / "good"), "--tokenizer", "bytes",
                 "--no-progress"]) == 0
    (d / "trunc").mkdir()
    for name in os.listdir(d / "good"):
        data = (d / "good" / name).read_bytes()
        (d / "trunc" / name).write_bytes(data[:100] if name.endswith(".h5") else data)
    files = {"deep.jsonl": DEEP + "\n", "notext.jsonl": '{"body": "x"}\n',
             "cut.jsonl": '{"text": "a"}\n{"text": \n', "garbage.parquet": "PAR1 not Parquet",
             "tok.json": "{garbage", "afile": "x"}
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "bad.txt").write_bytes(b"\xff\xfe not UTF-8")
    for name, text in (("m_deep", DEEP), ("m_list", "[1, 2]"), ("m_cut", '{"format_version": 1,'),
                       ("m_kind", json.dumps({"format_version": 1, "kind": "x"}))):
        (d / name).mkdir()
        (d / name / "manifest.json").write_text(text)
    return d


SHARD = ["shard", "--tokenizer", "bytes", "--no-progress", "--output"]
CASES = [  # (argv with {d} for the folder, what the line must name)
    (SHARD + ["{d}/o", "--input", "{d}/missing.txt"], "{d}/missing.txt"),
    (SHARD + ["{d}/o", "--input", "{d}/deep.jsonl"], "{d}/deep.jsonl:1"),
    (SHARD + ["{d}/o", "--input", "{d}/notext.jsonl"], "{d}/notext.jsonl:1"),
    (SHARD + ["{d}/o", "--input", "{d}/cut.jsonl"], "{d}/cut.jsonl:2"),
    (SHARD + ["{d}/o", "--input", "{d}/bad.txt"], "{d}/bad.txt"),
    (SHARD + ["{d}/o", "--input", "{d}/garbage.parquet"], "{d}/garbage.parquet"),
    (SHARD + ["{d}/afile", "--input", "{d}/bad.txt"], "{d}/afile"),
    (SHARD + ["{d}/o", "--input", "{d}/bad.txt", "--shard-tokens", "0"], "--shard-tokens"),
    (["shard", "--input", "{d}/bad.txt", "--output", "{d}/o", "--tokenizer", "{d}/tok.json"],
     "{d}/tok.json"),
    (["blend", "--input", "{d}/missing:1", "--output", "{d}/b"], "{d}/missing"),
    (["blend", "--input", "{d}/good:x", "--output", "{d}/b"], "{d}/good"),
    (["blend", "--input", "{d}/m_deep:1", "--output", "{d}/b"], "{d}/m_deep/manifest.json"),
    (["verify", "{d}/m_deep"], "{d}/m_deep/manifest.json"),
    (["verify", "{d}/m_cut"], "{d}/m_cut/manifest.json"),
    (["verify", "{d}/trunc"], "{d}/trunc/train_00000.h5"),
    (["inspect", "{d}/m_list"], "{d}/m_list/manifest.json"),
    (["inspect", "{d}/m_deep"], "{d}/m_deep/manifest.json"),
    (["stats", "{d}/m_kind"], "{d}/m_kind/manifest.json"),
    (["stats", "{d}/trunc"], "{d}/trunc/train_00000.h5"),
    (["stats", "{d}/m_deep"], "{d}/m_deep/manifest.json"),
    (["validate", "--input", "{d}/garbage.parquet"], "{d}/garbage.parquet"),
    (["validate", "--input", "{d}/missing.txt"], "{d}/missing.txt"),
    (["train-tokenizer", "--input", "{d}/missing.txt", "--output", "{d}/t"], "{d}/missing.txt"),
    (["train-tokenizer", "--input", "{d}/bad.txt", "--output", "{d}/t", "--vocab-size", "0"],
     "--vocab-size"),
]


@pytest.mark.parametrize("argv, named", CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_a_failure_is_one_error_line_naming_the_input(inputs, capsys, argv, named):
    rc = main([a.format(d=inputs) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc != 0 and len(err) == 1, err
    assert err[0].startswith("error: ") and named.format(d=inputs) in err[0], err


@pytest.mark.parametrize("argv, named", [
    (["shard", "--input", "x.txt", "--output", "o", "--tokenizer", "bytes", "--shard-tokens",
      "abc"], "--shard-tokens"),
    (["verify"], "DIR"),
    (["inspect", "{d}/m_deep"], "{d}/m_deep/manifest.json")])
def test_a_real_process_prints_one_line_and_no_traceback(inputs, argv, named):
    r = subprocess.run([sys.executable, "-m", "data_tools", *[a.format(d=inputs) for a in argv]],
                       cwd=inputs, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith("error: ") and named.format(d=inputs) in err[0], err
