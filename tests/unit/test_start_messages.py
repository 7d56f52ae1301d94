"""Start-up errors say what to do (issue #31, item 8): `train` without --config names --config
and the keys it needs; a relative data.path that is not a dataset names the directory it was
resolved from."""
from __future__ import annotations

import os
import sys

import pytest

from data_tools.format import DataError, read_manifest
from hpctrain import config as config_mod
from hpctrain.errors import ConfigError
from tests.conftest import run_cmd


def test_no_config_file_names_the_flag_and_the_required_keys():
    with pytest.raises(ConfigError) as ei:
        config_mod.load(None, ["--run.dir=x"])
    msg = str(ei.value)
    assert "'data.path'" in msg and "--config" in msg and "overrides" not in msg
    for key in ("--run.dir", "--data.path", "--model.n_layer", "--train.steps"):
        assert key in msg


def test_a_config_file_missing_a_key_names_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\ndir = 'x'\n")
    with pytest.raises(ConfigError, match=rf"missing required config key 'data.path' in {cfg}$"):
        config_mod.load(cfg)


@pytest.mark.parametrize("make_dir", [False, True], ids=["absent", "not_a_dataset"])
def test_relative_data_path_names_the_current_directory(tmp_path, monkeypatch, make_dir):
    monkeypatch.chdir(tmp_path)
    if make_dir:
        (tmp_path / "corpus").mkdir()
    with pytest.raises(DataError) as ei:
        read_manifest("corpus")
    msg = str(ei.value)
    assert msg.startswith("corpus/manifest.json: missing") and str(tmp_path) in msg
    assert ("corpus does not exist" in msg) is not make_dir
    with pytest.raises(DataError) as absolute:
        read_manifest(str(tmp_path / "corpus"))
    assert "current directory" not in str(absolute.value)


def test_train_without_config_is_one_line(tmp_path):
    r = run_cmd([sys.executable, "-m", "hpctrain", "train"], timeout=120, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:")
    assert "--config" in lines[0] and "--data.path" in lines[0]
