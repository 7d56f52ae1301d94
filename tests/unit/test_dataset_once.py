"""data.path's manifest.json is read once per rank at a train start (hpctrain.data.dataset.Dataset),
for a plain dataset with or without the node cache and for a blend; counted by wrapping `open` in
the training process (1 rank, a real `hpctrain train` of 1 step). And resuming a run on another
dataset, a blend or another global batch is one `error:` line naming the key and checkpoint."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import TINY_TRAIN, run_cmd

# Runs `python -m hpctrain ARGS` with every open() of <data>/manifest.json counted.
COUNTING = """
import atexit, builtins, io, os, runpy, sys
target = os.path.join(sys.argv[1], "manifest.json")
reads, real_open = [], builtins.open
def counting_open(f, *a, **k):
    if isinstance(f, (str, os.PathLike)) and os.path.abspath(f) == target:
        reads.append(1)
    return real_open(f, *a, **k)
builtins.open = io.open = counting_open
atexit.register(lambda: print(f"manifest reads: {len(reads)}", file=sys.stderr))
sys.argv = ["hpctrain", *sys.argv[2:]]
runpy.run_module("hpctrain", run_name="__main__")
"""


def manifest_reads(tmp_path, data, *overrides) -> int:
    cfg = tmp_path / "train.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp_path / "run", data=data, steps=1))
    r = run_cmd([sys.executable, "-c", COUNTING, str(data), "train", "--config", cfg, *overrides],
                timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stderr.rsplit("manifest reads: ", 1)[1].split()[0])


@pytest.mark.parametrize("cache", ["off", "on"])
def test_plain_dataset_manifest_read_once(one_play, tmp_path, cache):
    overrides = ["--data.cache_dir=off"] if cache == "off" else [
        f"--data.cache_dir={tmp_path / 'cache'}"]
    assert manifest_reads(tmp_path, one_play, "--train.eval_interval=1", *overrides) == 1




@pytest.fixture(scope="module")
def blend(one_play, two_plays, tmp_path_factory):
    out = tmp_path_factory.mktemp("blend") / "b"
    run_cmd([sys.executable, "-m", "data_tools", "blend", "--input", f"{one_play}:1",
             f"{two_plays}:1", "--output", out], check=True, timeout=120)
    return out


def train(cfg, *overrides):
    return run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg,
                    "--data.cache_dir=off", *overrides], timeout=300)


@pytest.mark.parametrize("first, then, key", [
    ("one_play", "blend", "data.path"),  # plain -> blend
    ("blend", "one_play", "data.path"),  # blend -> plain
    ("one_play", "two_plays", "data.path"),  # another plain dataset (other sample count)
    ("one_play", "--train.micro_batch_size=4", "train.micro_batch_size"),  # other global batch
])
def test_resume_on_other_data_is_one_line(request, tmp_path, first, then, key):
    """The sampler's refusals (data/sampler.py, data/mixture.py load_state_dict) reach the user
    as one `error:` line naming the key and the checkpoint, never a traceback."""
    cfg = tmp_path / "train.toml"
    cfg.write_text(TINY_TRAIN.format(run=tmp_path / "run", data=request.getfixturevalue(first),
                                     steps=1))
    assert train(cfg).returncode == 0
    change = [then] if then.startswith("--") else [f"--data.path={request.getfixturevalue(then)}"]
    r = train(cfg, "--train.steps=2", *change)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert f"'{key}'" in errors[0] and str(tmp_path / "run" / "checkpoints" / "step_00000001") \
        in errors[0], errors[0]


def test_blend_manifest_read_once(blend, tmp_path):
    assert manifest_reads(tmp_path, blend, "--data.cache_dir=off") == 1
