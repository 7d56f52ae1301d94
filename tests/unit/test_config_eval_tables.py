"""`[[eval]]` tables (#53): a list of tables in the config, read, written back and checked, every
error naming `eval[i].key`; the window counts of a named set."""
import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.metrics.tensorboard import tag_for
from hpctrain.train.named_evals import set_shape
from tests.unit.test_config import MINIMAL

TABLES = """
[[eval]]
name = "wiki"
data = "data/wiki"
interval = 5

[[eval]]
name = "code.py-3"
data = "data/code"
split = "test"
max_batches = 2
max_tokens = 4096
"""


def load(tmp_path, text, overrides=()):
    p = tmp_path / "c.toml"
    p.write_text(text + MINIMAL, encoding="utf-8")  # tables first: MINIMAL ends inside [train]
    return config.load(p, list(overrides))


def test_tables_read_in_order_with_defaults(tmp_path):
    cfg = load(tmp_path, TABLES)
    assert [(e.name, e.data, e.split, e.interval, e.max_batches, e.max_tokens) for e in cfg.eval] == [
        ("wiki", "data/wiki", "val", 5, 0, 0), ("code.py-3", "data/code", "test", 0, 2, 4096)]
    assert load(tmp_path, "").eval == []


def test_roundtrip_through_toml(tmp_path):
    """config.toml of a run with [[eval]] reads back equal; one without has no [[eval]] at all
    (the config.toml of every existing run stays byte-identical)."""
    cfg = load(tmp_path, TABLES, ["--train.steps=7"])
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml(cfg), encoding="utf-8")
    assert config.load(again) == cfg and config.to_toml(config.load(again)).count("[[eval]]") == 2
    assert "[[eval]]" not in config.to_toml(load(tmp_path, ""))


@pytest.mark.parametrize("text, overrides, key", [
    ('[[eval]]\nname = "a"\ndata = "d"\nintervall = 5\n', [], "eval[0].intervall"),
    ('[[eval]]\nname = "a"\ndata = "d"\n[[eval]]\nname = "b"\n', [], "eval[1].data"),
    ('[[eval]]\nname = "a"\ndata = "d"\ninterval = "often"\n', [], "eval[0].interval"),
    ('[[eval]]\nname = "a"\ndata = "d"\nmax_tokens = -1\n', [], "eval[0].max_tokens"),
    ('[[eval]]\nname = "a"\ndata = "d"\n[[eval]]\nname = "a"\ndata = "e"\n', [], "eval[1].name"),
    ('[[eval]]\nname = "a b"\ndata = "d"\n', [], "eval[0].name"),
    ('[[eval]]\nname = "a"\ndata = ""\n', [], "eval[0].data"),
    ('[[eval]]\nname = "a"\ndata = "d"\n', ["--train.eval_interval=0"], "eval[0].interval"),
    ('[[eval]]\nname = "a"\ndata = "d"\n', ["--sync.mode=ps"], "'eval'"),
    ('eval = 3\n', [], "'eval'"),
    ('', ["--eval.name=a"], "'eval'"),
])
def test_bad_tables_name_the_key(tmp_path, text, overrides, key):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text, overrides)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_key_suggests_the_near_one(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean eval\[0\]\.max_tokens"):
        load(tmp_path, '[[eval]]\nname = "a"\ndata = "d"\nmax_token = 5\n')


def test_help_lists_every_table_key():
    lines = [line.split()[1].split("=")[0] for line in config.describe().splitlines() if "[[eval]]" in line]
    assert lines == ["name", "data", "split", "interval", "max_batches", "max_tokens"]


@pytest.mark.parametrize("n_windows, batches, max_tokens, shape", [
    (10_000, 8, 0, (4, 8)),       # the val split's shape: 8 micro-batches of 4 per rank
    (20, 8, 0, (1, 8)),           # a short split: one window per micro-batch
    (10_000, 2, 12 * 32, (3, 2)),  # max_tokens = 12 windows: 3 x 2 x 2 ranks
    (10_000, 8, 5 * 32, (1, 2)),  # 5 windows over 2 ranks: 2 micro-batches of 1 each
    (1, 8, 0, (0, 0)),            # fewer windows than ranks
])
def test_set_shape(n_windows, batches, max_tokens, shape):
    assert set_shape(n_windows, batches, micro=4, dp=2, block=32, max_tokens=max_tokens) == shape


def test_tensorboard_tags_are_the_metric_names():
    assert tag_for("eval/wiki/loss") == "eval/wiki/loss" and tag_for("eval/wiki/bpb") == "eval/wiki/bpb"
    assert tag_for("val_loss") == "val/loss"


def test_the_recipe_loads_with_its_sets():
    from tests.conftest import ROOT

    cfg = config.load(ROOT / "configs" / "demo_eval.toml")
    assert [(e.name, e.interval or cfg.train.eval_interval) for e in cfg.eval] == [("plays", 200), ("hamlet", 100)]
