"""configs/llama_long.toml (#51's long-context recipe): a Llama-3.1-8B-shaped folder continued at
4x its original context with the folder's rope scaling, context parallelism and document masking;
its [parallel] is what `hpctrain plan` recommends for it on one node of 8 x 80 GB GPUs, and its
comments' figures are the planner's. The tests that load the TOML need parallel.cp in the config
schema (the wiring branch, i51-wire): they skip, naming it, until it is there."""
from __future__ import annotations

import dataclasses
import re
import tomllib

import pytest

from hpctrain import config
from hpctrain.config_schema import ParallelConfig
from hpctrain.plan.cli import main as plan_main
from tests.conftest import ROOT
from tests.hf_configs import write_config_folder

LONG = ROOT / "configs" / "llama_long.toml"
RAW = tomllib.loads(LONG.read_text())
HAS_CP = "cp" in {f.name for f in dataclasses.fields(ParallelConfig)}
needs_cp = pytest.mark.skipif(not HAS_CP, reason="parallel.cp is not a config key yet (branch i51-wire)")


def _comment_layout() -> str:
    return re.search(r"planner's for 1 node .*?: (fsdp \S+ cp\d+ tp\d+ pp\d+ mb\S+ ac=\w+)",
                     " ".join(x.lstrip("# ") for x in LONG.read_text().splitlines() if x.startswith("#")),
                     re.S).group(1)


def _recommended(capsys, args) -> str:
    assert plan_main([str(a) for a in args]) == 0
    return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended: "))


def test_its_layout_is_the_planners_for_its_model_on_one_node(capsys):
    """The Llama-3.1-8B shape (llama3-8b's) at the config's block_size and global batch."""
    line = _recommended(capsys, ["--preset", "llama3-8b", "--block-size", RAW["model"]["block_size"],
                                 "--global-batch", RAW["train"]["global_batch"], "--nodes", 1])
    assert line.startswith(f"recommended: {_comment_layout()}: ")
    p = RAW["parallel"]
    for key in ("cp", "cp_attention", "tp", "data_parallel", "activation_checkpoint"):
        assert f"--parallel.{key}={p[key]} " in line
    assert RAW["model"]["block_size"] == 4 * 8192 and RAW["data"]["document_mask"] is True


@needs_cp
def test_it_loads_with_the_folders_rope_scaling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # init.from's relative path: models/Llama-3.1-8B
    write_config_folder(tmp_path / RAW["init"]["from"])
    cfg = config.load(str(LONG))
    m = cfg.model
    assert (m.arch, m.n_layer, m.n_embd, m.n_kv_head, m.vocab_size) == ("llama", 32, 4096, 8, 128256)
    assert (m.block_size, m.max_positions) == (32768, 131072)
    assert (m.rope_scaling_factor, m.rope_original_max_positions) == (8.0, 8192)
    assert m.block_size == 4 * m.rope_original_max_positions
    assert (cfg.parallel.cp, cfg.data.document_mask) == (4, True)
    assert m.block_size % (2 * cfg.parallel.cp) == 0
    from hpctrain.train.model_setup import size_error  # as test_model_size_check holds every config
    assert size_error(m, 32 * 80 * 10 ** 9, "4 nodes") is None


@needs_cp
def test_planning_the_config_recommends_its_own_layout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_config_folder(tmp_path / RAW["init"]["from"])
    line = _recommended(capsys, ["--config", LONG, "--nodes", 1, "--sbatch", tmp_path / "long.sbatch"])
    assert line.startswith(f"recommended: {_comment_layout()}: ")
    assert "--parallel.cp=4 --parallel.cp_attention=ring" in (tmp_path / "long.sbatch").read_text()
