"""train.global_batch: the accumulation derived from the data-parallel size once the mesh is known
(elastic restart on another node count keeps the global batch), and its one-line ConfigErrors."""
import dataclasses

import pytest

from hpctrain import config
from hpctrain.config_rules import check_resume_batch, global_batch_line, resolve_grad_accum
from hpctrain.errors import ConfigError
from tests.conftest import model_section

BASE = """
[run]
dir = "runs/x"
[data]
path = "data/x"
""" + model_section(n_embd=32, block_size=16) + """[train]
steps = 10
micro_batch_size = 4
"""


def load(tmp_path, *overrides):
    p = tmp_path / "c.toml"
    p.write_text(BASE)
    return config.load(p, list(overrides))


def resolved(train, dp):
    """What the trainer does once the mesh is built: train.grad_accum becomes the derived value."""
    return dataclasses.replace(train, grad_accum=resolve_grad_accum(train, dp))


def test_accumulation_follows_dp(tmp_path):
    t = load(tmp_path, "--train.global_batch=24").train
    assert t.global_batch == 24 and t.grad_accum == 1  # the loaded config keeps it as given
    assert {dp: resolve_grad_accum(t, dp) for dp in (1, 2, 3, 6)} == {1: 6, 2: 3, 3: 2, 6: 1}
    for dp in (1, 2, 3, 6):
        r = resolved(t, dp)
        assert r.micro_batch_size * r.grad_accum * dp == 24


def test_off_keeps_grad_accum(tmp_path):
    t = load(tmp_path, "--train.grad_accum=5").train
    assert t.global_batch == 0
    assert [resolve_grad_accum(t, dp) for dp in (1, 2, 3, 7)] == [5, 5, 5, 5]


def test_dp_that_does_not_split_is_one_line_naming_the_key(tmp_path):
    t = load(tmp_path, "--train.global_batch=24").train
    with pytest.raises(ConfigError) as e:
        resolve_grad_accum(t, 5)
    assert str(e.value) == ("config key 'train.global_batch': 24 sequences per step do not split over "
                            "dp=5 ranks x micro_batch_size 4; use a world whose dp divides 6 "
                            "(1, 2, 3, 6) or change train.global_batch")
    for dp in (4, 7, 12):  # 12 > 6: more ranks than micro-batches
        with pytest.raises(ConfigError, match=r"^config key 'train\.global_batch': .* dp=%d " % dp):
            resolve_grad_accum(t, dp)


def test_divisor_list_of_a_large_batch(tmp_path):
    t = load(tmp_path, "--train.global_batch=4096", "--train.micro_batch_size=1").train
    assert resolve_grad_accum(t, 64) == 64
    with pytest.raises(ConfigError) as e:
        resolve_grad_accum(t, 3)
    assert "dp divides 4096 (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)" in str(e.value)


def test_global_batch_with_grad_accum_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, "--train.global_batch=8", "--train.grad_accum=2")
    msg = str(e.value)
    assert msg.startswith("config key 'train.global_batch': 8 with train.grad_accum=2")
    assert "\n" not in msg
    assert load(tmp_path, "--train.global_batch=8", "--train.grad_accum=1").train.global_batch == 8


@pytest.mark.parametrize("value, expect", [
    ("10", "10 is not a multiple of train.micro_batch_size=4"),
    ("-4", "must be >= 0"),
])
def test_bad_values_are_refused_at_load(tmp_path, value, expect):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, f"--train.global_batch={value}")
    assert str(e.value).startswith("config key 'train.global_batch': ") and expect in str(e.value)


def test_log_line(tmp_path):
    t = load(tmp_path, "--train.global_batch=24").train
    assert global_batch_line(resolved(t, 2), 2) == "train.global_batch 24 = micro_batch 4 x grad_accum 3 x dp 2"
    assert global_batch_line(resolved(t, 3), 3) == "train.global_batch 24 = micro_batch 4 x grad_accum 2 x dp 3"


def test_resume_on_fewer_nodes_keeps_the_global_batch(tmp_path):
    """3 nodes -> 2 nodes: with global_batch the accumulation goes 2 -> 3 and the resume passes."""
    t = load(tmp_path, "--train.global_batch=24").train
    saved = resolved(t, 3).micro_batch_size * resolved(t, 3).grad_accum * 3  # the sampler's global_batch
    assert saved == 24
    check_resume_batch(saved, resolved(t, 2), 2, "ckpt/step_10")
    check_resume_batch(saved, resolved(t, 1), 1, "ckpt/step_10")


def test_resume_with_fixed_accumulation_on_fewer_nodes_is_refused(tmp_path):
    fixed = load(tmp_path, "--train.grad_accum=2").train  # 4 x 2 x 3 = 24 saved; 4 x 2 x 2 = 16 now
    with pytest.raises(ConfigError) as e:
        check_resume_batch(24, resolved(fixed, 2), 2, "ckpt/step_10")
    msg = str(e.value)
    assert "global batch 4 x 2 x 2 = 16 differs from checkpoint ckpt/step_10 (24 sequences" in msg
    assert "set train.global_batch = 24" in msg


def test_resume_with_another_global_batch_names_the_key(tmp_path):
    t = load(tmp_path, "--train.global_batch=16").train
    with pytest.raises(ConfigError) as e:
        check_resume_batch(24, resolved(t, 2), 2, "ckpt/step_10")
    assert str(e.value).startswith("config key 'train.global_batch': 16 differs from checkpoint "
                                   "ckpt/step_10 (24 sequences per step)")


def test_help_describes_the_key():
    line = next(l for l in config.describe().splitlines() if "--train.global_batch=" in l)
    assert "[0]" in line and "sequences per optimizer step over the whole job" in line
    assert "derived" in line and "grad_accum" in line
