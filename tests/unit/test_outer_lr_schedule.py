"""DiLoCo's outer lr schedule (sync.outer_final_lr): a cosine from sync.outer_lr to it over
train.steps, as the inner lr's (down or up); 0 keeps the constant outer lr
(bad values: tests/unit/test_config.py)."""
import math

import pytest

from hpctrain.config import SyncConfig
from hpctrain.sync.diloco import outer_lr_at


def test_cosine_from_outer_lr_to_the_final_one():
    cfg = SyncConfig(mode="diloco", outer_lr=0.7, outer_final_lr=0.35)
    at = [outer_lr_at(cfg, step, 2000) for step in (0, 500, 1000, 1500, 2000, 2100)]
    expected = [0.7, 0.35 + 0.175 * (1 + math.cos(math.pi / 4)), 0.525,
                0.35 + 0.175 * (1 - math.cos(math.pi / 4)), 0.35, 0.35]
    assert at == pytest.approx(expected, abs=1e-12)
    assert at[1] == pytest.approx(0.64874369, abs=1e-8) and at[3] == pytest.approx(0.40125631, abs=1e-8)


def test_a_final_lr_above_outer_lr_rises_as_the_inner_lr_decays():
    cfg = SyncConfig(mode="diloco", outer_lr=0.7, outer_final_lr=1.0)
    at = [outer_lr_at(cfg, step, 2000) for step in (0, 1000, 2000)]
    assert at == pytest.approx([0.7, 0.85, 1.0], abs=1e-12)


def test_zero_keeps_the_constant_outer_lr_exactly():
    cfg = SyncConfig(mode="diloco", outer_lr=0.7)
    assert cfg.outer_final_lr == 0.0
    assert {outer_lr_at(cfg, step, 2000) for step in range(0, 2001, 7)} == {0.7}
