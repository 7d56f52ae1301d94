"""`blend`: the mixture manifest and its errors, exact proportions, DP-size independence, exact
resume, windows equal to the components' own, verify and the node cache through a blend."""
import json
import os
import shutil
from fractions import Fraction

import numpy as np
import pytest

from data_tools.__main__ import main
from data_tools.blend import (MAX_PERIOD, apportion, blend_datasets, data_manifest, parse_input,
                              resolve_blend)
from data_tools.corpora import shakespeare_files
from data_tools.format import DataError, read_blend_manifest, read_manifest, sha256_file
from data_tools.mpiutil import SerialComm
from data_tools.shard import shard_dataset
from data_tools.verify import verify_dataset
from hpctrain.data import (BlendShards, GlobalSampler, MixtureSampler, TokenShards, make_sampler,
                           open_split, split_for_rank)
from hpctrain.data.cache import NodeCache
from hpctrain.data.mixture import interleave
from hpctrain.errors import ConfigError
from tests.conftest import TINY_MODEL

QUIET = dict(progress=False, log=lambda m: None)
T = 32


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory):
    """Real components: different Shakespeare plays (byte tokenizer; b has no val split) and
    a gpt2-tokenized one."""
    root = tmp_path_factory.mktemp("blend")
    plays = shakespeare_files()
    shard_dataset(plays[0:2], str(root / "a"), tokenizer="bytes", shard_tokens=60_000,
                  val_fraction=0.5, seed=1, **QUIET)
    shard_dataset(plays[2:3], str(root / "b"), tokenizer="bytes", shard_tokens=50_000,
                  val_fraction=0.0, seed=1, **QUIET)
    shard_dataset(plays[3:4], str(root / "g"), tokenizer="gpt2", shard_tokens=50_000,
                  val_fraction=0.0, seed=1, **QUIET)
    shard_dataset(plays[4:6], str(root / "v"), tokenizer="bytes", shard_tokens=80_000,
                  val_fraction=0.5, seed=2, **QUIET)
    blend_datasets([(str(root / "a"), "0.7"), (str(root / "b"), "0.3")], str(root / "mix"), seed=4)
    return root


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_manifest_contents_and_summary(parts_dir, capsys):
    mix = parts_dir / "mix"
    assert sorted(os.listdir(mix)) == ["manifest.json"]  # no token data is copied
    m = read_blend_manifest(str(mix))
    assert (m["kind"], m["seed"], m["period"], m["format_version"]) == ("blend", 4, 10, 1)
    assert m["tokenizer"] == {"name": "bytes", "vocab_size": 257, "eot_id": 256}
    assert m["dtype"] == "uint16"
    for c, name, w, k in zip(m["components"], "ab", (0.7, 0.3), (7, 3)):
        assert c["path"] == f"../{name}"  # relative to the blend: movable together
        assert c["manifest_sha256"] == sha256_file(str(parts_dir / name / "manifest.json"))
        assert (c["weight"], c["parts"]) == (pytest.approx(w), k)
        assert c["n_tokens"] == read_manifest(str(parts_dir / name))["n_tokens"]
    with pytest.raises(DataError, match="a blend of datasets .*components: ../a, ../b"):
        read_manifest(str(mix))  # readers of sharded datasets refuse a blend with one line
    # the CLI: any weight scale normalizes to the same blend; it prints the summary
    out = parts_dir / "mix_cli"
    assert main(["blend", "--input", f"{parts_dir / 'a'}:7", f"{parts_dir / 'b'}:3", "--output",
                 str(out), "--seed", "4", "--tokens", "1000000"]) == 0
    text = capsys.readouterr().out
    assert "2 components" in text and "weight 0.7000" in text
    assert "epochs of its train split" in text
    assert read_blend_manifest(str(out))["components"] == m["components"]
    assert main(["blend", "--input", f"{parts_dir / 'a'}:1", "--output", str(out)]) == 0  # replace
    assert len(read_blend_manifest(str(out))["components"]) == 1
    assert main(["inspect", str(mix)]) == 0 and "[1] " in capsys.readouterr().out
    assert main(["verify", str(mix)]) == 0
    assert capsys.readouterr().out.startswith(f"{mix}: OK (")


def test_weights_to_parts():
    F = Fraction
    assert apportion([F("0.7"), F("0.3")]) == [7, 3]
    assert apportion([F(2), F(2), F(4)]) == [1, 1, 2]
    assert apportion([F("1/3"), F("2/3")]) == [1, 2]
    big = apportion([F(1541507), F(24494), F(3)])
    assert sum(big) <= MAX_PERIOD + 3 and min(big) >= 1
    assert abs(big[0] / sum(big) - 1541507 / 1566004) < 2 / MAX_PERIOD
    assert parse_input("x:y/data:0.25") == ("x:y/data", F(1, 4))


def test_errors_are_one_line(parts_dir, capsys, tmp_path):
    a, b, g, mix = (str(parts_dir / n) for n in ("a", "b", "g", "mix"))
    out = str(tmp_path / "o")
    assert one_line_error(capsys, ["blend", "--input", f"{tmp_path}:1", "--output", out]) == \
        f"error: {tmp_path}/manifest.json: missing — not an hpctrain dataset or an incomplete shard run"
    for w, why in (("0", "must be > 0"), ("-2", "must be > 0"), ("x", "is not a number"),
                   ("nan", "is not a number")):
        assert one_line_error(capsys, ["blend", "--input", f"{a}:{w}", f"{b}:1", "--output", out]) \
            == f"error: {a}: weight '{w}' {why}"
    assert "expected DIR:WEIGHT" in one_line_error(capsys, ["blend", "--input", a, "--output", out])
    err = one_line_error(capsys, ["blend", "--input", f"{a}:1", f"{g}:1", "--output", out])
    assert err.startswith(f"error: {g}/manifest.json: tokenizer gpt2 (vocab_size 50257") and a in err
    assert "blends of blends" in one_line_error(capsys, ["blend", "--input", f"{mix}:1",
                                                         "--output", out])
    assert "listed twice" in one_line_error(capsys, ["blend", "--input", f"{a}:1", f"{a}:2",
                                                     "--output", out])
    assert not os.path.exists(out)  # nothing written on an error
    with pytest.raises(DataError, match=r"unknown split 'test' \(splits are train, val\)"):
        BlendShards(mix, "test", T)
    with pytest.raises(DataError, match=r"/b/manifest.json: no shards for split 'val'"):
        BlendShards(mix, "val", T)  # without optional=True a component lacking val is an error
    # a component changed (re-sharded) after blending, or gone: one line naming its manifest
    c = tmp_path / "c"
    shutil.copytree(b, c)
    blend_datasets([(a, 1), (str(c), 1)], str(tmp_path / "m2"))
    shard_dataset(shakespeare_files()[2:3], str(c), tokenizer="bytes", shard_tokens=40_000,
                  val_fraction=0.0, seed=1, **QUIET)
    err = one_line_error(capsys, ["verify", str(tmp_path / "m2")])
    assert err.startswith(f"error: {c}/manifest.json: changed since the blend was made")
    assert "re-run" in err
    shutil.rmtree(c)
    err = one_line_error(capsys, ["inspect", str(tmp_path / "m2")])
    assert err.startswith(f"error: {c}/manifest.json: missing (component 1 of the blend")


def test_interleave_prefix_counts_within_one():
    for parts, seed in (([7, 3], 0), ([1, 1], 3), ([5, 2, 9, 1], 1), ([1, 250, 33], 2)):
        pat = interleave(parts, seed)
        P = sum(parts)
        assert np.array_equal(np.bincount(pat, minlength=len(parts)), parts)
        seq = np.tile(pat, 3)  # the period repeats exactly
        n = np.arange(1, seq.size + 1)
        for i, p in enumerate(parts):
            counts = np.cumsum(seq == i)
            assert np.all(np.abs(counts - n * p / P) < 1), (parts, i)


def test_sampled_components_exact_proportions(parts_dir):
    with BlendShards(str(parts_dir / "mix"), "train", T) as ds:
        s = make_sampler(ds, global_batch=8, seed=11)
        assert isinstance(s, MixtureSampler)
        idx = np.concatenate([s.next_indices() for _ in range(125)])  # 1000 samples
    comp = np.searchsorted(ds.offsets, idx, side="right") - 1
    n = np.arange(1, idx.size + 1)
    for c, w in ((0, 0.7), (1, 0.3)):
        counts = np.cumsum(comp == c)
        assert np.all(np.abs(counts - np.round(n * w)) <= 1)  # every prefix, not just the total
        assert counts[-1] == round(1000 * w)
        mine = idx[comp == c][: ds.sizes[c]]  # each component's first epoch: no repeats
        assert len(set(mine.tolist())) == mine.size
    assert s.component_epochs() == pytest.approx([700 / ds.sizes[0], 300 / ds.sizes[1]])


def test_same_order_for_any_dp_size_and_exact_resume(parts_dir):
    ds = BlendShards(str(parts_dir / "mix"), "train", T)
    gb = 24
    ref_sampler = make_sampler(ds, gb, seed=5)
    ref = [ref_sampler.next_indices() for _ in range(60)]
    assert all(np.array_equal(ref[k], ref_sampler.copy().indices_at(k)) for k in (0, 17, 59))
    for dp, mb, accum in ((1, 6, 4), (2, 3, 4), (4, 3, 2), (4, 6, 1)):
        s = make_sampler(ds, gb, seed=5)
        for k in range(60):
            g = s.next_indices()
            assert np.array_equal(g, ref[k])
            parts = [split_for_rank(g, r, dp, mb, accum) for r in range(dp)]
            assert np.array_equal(np.concatenate([m for p in parts for m in p]), g)
    assert not np.array_equal(make_sampler(ds, gb, seed=6).next_indices(), ref[0])
    # resume mid-stream from a JSON round trip of the state; the saved seed wins
    s = make_sampler(ds, gb, seed=5)
    for _ in range(23):
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))
    assert state["kind"] == "blend" and state["global_batch"] == gb and state["parts"] == [7, 3]
    r = make_sampler(ds, gb, seed=0)
    r.load_state_dict(state)
    assert r.steps_done == 23
    for k in range(23, 60):
        assert np.array_equal(r.next_indices(), ref[k])
    with pytest.raises(ConfigError, match="weights changed"):
        MixtureSampler(ds.sizes, [2, 1], gb, 5, ds.seed).load_state_dict(state)
    with pytest.raises(ConfigError, match="component .* changed"):
        MixtureSampler(ds.sizes + 1, ds.parts, gb, 5, ds.seed).load_state_dict(state)
    with pytest.raises(ConfigError, match="plain .* now a blend"):
        r.load_state_dict(GlobalSampler(len(ds), gb, 5).state_dict())
    with pytest.raises(ConfigError, match="blend dataset but data.path is now a plain"):
        GlobalSampler(len(ds), gb, 5).load_state_dict(state)


def test_windows_equal_component_windows(parts_dir):
    mix = str(parts_dir / "mix")
    ds = open_split(mix, "train", T)
    comps = [TokenShards(str(parts_dir / n), "train", T) for n in "ab"]
    assert [len(c) for c in comps] == ds.sizes.tolist() and len(ds) == sum(ds.sizes)
    idx = make_sampler(ds, 64, seed=2).next_indices()
    got = ds.batch(idx)
    for row, i in enumerate(idx.tolist()):
        c, j = ds.locate(i)
        assert np.array_equal(got[row].numpy(), comps[c].window(j))
        assert np.array_equal(ds.window(i), comps[c].window(j))
    # validation mixes the components' val splits; b has none, so only a's is used (with a note)
    val = open_split(mix, "val", T, optional=True)
    assert len(val.components) == 1 and "left out" in val.notes[0]
    ev = val.eval_indices(10)
    assert np.array_equal(val.batch(ev), TokenShards(str(parts_dir / "a"), "val", T).batch(ev))


def test_eval_set_mixes_val_splits_by_weight(parts_dir, tmp_path):
    mix = str(tmp_path / "mv")
    blend_datasets([(str(parts_dir / "a"), 3), (str(parts_dir / "v"), 1)], mix)
    val = BlendShards(mix, "val", T)
    comps = [TokenShards(str(parts_dir / n), "val", T) for n in "av"]
    ev = val.eval_indices(40)
    first = ev < val.sizes[0]
    assert first.sum() == 30 and (~first).sum() == 10  # 3:1 whatever the val splits' sizes
    assert np.array_equal(ev, val.eval_indices(40))  # fixed: comparable across evaluations
    for c, m in ((0, first), (1, ~first)):
        local = ev[m] - val.offsets[c]
        assert local.min() == 0 and local.max() == val.sizes[c] - 1  # spread over the split
        assert np.array_equal(val.batch(ev[m]), comps[c].batch(local))


def test_verify_names_a_bad_component_shard(parts_dir, tmp_path):
    a2 = tmp_path / "a2"
    shutil.copytree(parts_dir / "a", a2)
    mix = str(tmp_path / "m")
    blend_datasets([(str(parts_dir / "b"), 1), (str(a2), 1)], mix)
    flat = data_manifest(mix)
    n = len(flat["shards"])
    in_a2 = [s["component"] for s in flat["shards"]].count(1)
    assert in_a2 == len(read_manifest(str(a2))["shards"])
    assert verify_dataset(mix) == []
    assert sum((verify_dataset(mix, shard_indices=range(r, n, 3)) for r in range(3)), []) == []
    bad = a2 / "train_00001.h5"
    data = bytearray(bad.read_bytes())
    data[-40] ^= 1
    bad.write_bytes(bytes(data))
    problems = verify_dataset(mix)
    assert len(problems) == 1 and problems[0].startswith(f"{bad}: sha256 mismatch")
    where = next(i for i, s in enumerate(flat["shards"]) if s["src"] == str(bad))
    assert verify_dataset(mix, shard_indices=[where])[0].startswith(f"{bad}: sha256 mismatch")
    assert verify_dataset(mix, shard_indices=[i for i in range(n) if i != where]) == []


def test_node_cache_stages_components_without_collisions(parts_dir, tmp_path):
    mix = str(parts_dir / "mix")
    flat = data_manifest(mix)
    names = [s["file"] for s in flat["shards"]]
    assert len(set(names)) == len(names) and "c0-train_00000.h5" in names and \
        "c1-train_00000.h5" in names  # both components have a train_00000.h5
    _, comps = resolve_blend(mix)
    cache = NodeCache(str(tmp_path), mix, flat, SerialComm(), prefetch=2)
    cached = BlendShards(mix, "train", T, cache=cache)
    plain = BlendShards(mix, "train", T)
    sampler, planner = make_sampler(cached, 16, seed=1), make_sampler(cached, 16, seed=1)
    cache.start(0, 30, lambda k: cached.shard_ids_of(planner.indices_at(k)).tolist())
    for k in range(30):
        cache.publish(k)
        idx = sampler.next_indices()
        assert np.array_equal(cached.batch(idx), plain.batch(idx))
    cache.close()
    staged = sorted(f for f in os.listdir(cache.dir) if f.endswith(".h5"))
    assert {f.split("-")[0] for f in staged} == {"c0", "c1"}
    for f in staged:
        e = flat["shards"][names.index(f)]
        assert sha256_file(os.path.join(cache.dir, f)) == e["sha256"]
        assert e["src"].startswith(comps[e["component"]].path)


TRAIN = """
[run]
dir = "{run}"
[data]
path = "{data}"
cache_dir = "{cache}"
""" + TINY_MODEL + """[train]
steps = 4
micro_batch_size = 4
lr = 3e-3
warmup_steps = 1
eval_interval = 2
eval_batches = 1
log_interval = 2
[checkpoint]
interval = 2
"""


@pytest.mark.slow
@pytest.mark.parametrize("block_shards", [64, 1])
def test_training_on_a_blend_resumes_exactly(parts_dir, tmp_path, block_shards):
    """`hpctrain train` with data.path = a blend (one process): straight through the node cache
    vs. stopped at step 2 and resumed without it -> bit-identical losses (block_shards = 1:
    component a's epochs are block orders of several blocks, #21)."""
    import sys

    from tests.conftest import run_cmd

    def train(name, cache, *extra):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(TRAIN.format(run=tmp_path / name, data=parts_dir / "mix", cache=cache))
        return run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg,
                        f"--data.shuffle_block_shards={block_shards}", *extra],
                       timeout=300, check=True)

    def metrics(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    train("straight", tmp_path / "cache")
    train("resumed", "off", "--train.stop_at_step=2")
    assert "resumed from" in train("resumed", "off").stderr
    a, b = metrics("straight"), metrics("resumed")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for k in (3, 4):
        assert a[k]["loss"] == b[k]["loss"], (k, a[k]["loss"], b[k]["loss"])
    assert [a[k]["val_loss"] for k in (0, 2, 4)] == [b[k]["val_loss"] for k in (0, 2, 4)]
    assert a[4]["loss"] < a[1]["loss"] and a[1]["cache_copies"] > 0
    staged = [f for d in (tmp_path / "cache").glob("hpctrain-*/*") for f in os.listdir(d)
              if f.endswith(".h5")]
    assert {f.split("-")[0] for f in staged} == {"c0", "c1"}  # both components, no collisions
    states = [json.loads(p.read_text()) for p in (tmp_path / "resumed").rglob("trainer_state.json")]
    assert states and all((st["sampler"]["shuffle"], st["sampler"]["block_shards"])
                          == ("block", block_shards) for st in states), states


@pytest.mark.parametrize("weights", [("1e300",), ("1e-300", "1"), ("1e300", "1"),
                                     ("1e308", "1e308"), ("1", "1e-9"), ("5e-324", "1e-300"),
                                     ("123456789/7", "1e-4")])
def test_edge_weights_round_trip(parts_dir, tmp_path, capsys, weights):
    """Whatever blend writes, its readers accept: the manifest schema, the components, verify,
    the trainer's interleaving (each component exactly `parts` times per period)."""
    dirs = [str(parts_dir / n) for n in ("a", "b")][:len(weights)]
    out = str(tmp_path / "edge")
    assert main(["blend", "--input", *(f"{d}:{w}" for d, w in zip(dirs, weights)),
                 "--output", out]) == 0
    m = read_blend_manifest(out)
    parts = [c["parts"] for c in m["components"]]
    assert m["period"] == sum(parts) <= MAX_PERIOD and min(parts) >= 1
    assert all(0 < c["weight"] <= 1 for c in m["components"])
    assert len(resolve_blend(out)[1]) == len(weights)
    assert main(["verify", out]) == 0
    counts = np.bincount(interleave(parts, m["seed"]), minlength=len(parts))
    assert counts.tolist() == parts


@pytest.mark.parametrize("weights, bad", [(("1e400", "1"), 0), (("1", "1e-400"), 1),
                                          (("inf", "1"), 0), (("1e300", "1e-300"), 1),
                                          (("1e999999999", "1"), 0), (("1/1e400", "1"), 0)])
def test_unrepresentable_weights_refused_before_writing(parts_dir, tmp_path, capsys, weights, bad):
    dirs = [str(parts_dir / n) for n in ("a", "b")]
    out = tmp_path / "refused"
    err = one_line_error(capsys, ["blend", "--input", *(f"{d}:{w}" for d, w in zip(dirs, weights)),
                                  "--output", str(out)])
    assert err.startswith(f"error: {dirs[bad]}: weight ") and weights[bad] in err
    assert not out.exists() and not list(tmp_path.iterdir())  # no manifest, no lock file left
