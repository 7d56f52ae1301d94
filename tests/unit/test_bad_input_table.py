"""Bad input to `hpctrain train|sample|export` ends with one `error:` line naming the key, flag or
file, exit status != 0, no traceback, and nothing it watches changed (#30). Table-driven like
test_failure_table.py: each row sets up its input and names what the error line must contain;
every row fails before a training step, so each takes seconds. The rules themselves are unit-tested
in test_config.py.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL, TINY_TRAIN, checksums, run_cmd
from tests.hf_models import edit_weights
from tests.shared_dirs import shared_dir


@pytest.fixture(scope="module")
def dataset(one_play):
    return one_play


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset):  # noqa: F811 - the imported fixture
    """A run dir with one committed checkpoint (step 2) of TINY_TRAIN on `dataset`, trained once
    per session (tests/shared_dirs.py: xdist splits the rows between its workers; a row copies it
    before use)."""
    def build(tmp):
        cfg = tmp / "run.toml"
        cfg.write_text(TINY_TRAIN.format(run=tmp / "run", data=dataset, steps=2))
        run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg], check=True, timeout=180)
    tmp = shared_dir(tmp_path_factory, "bad_input_trained", build)
    return tmp / "run.toml", tmp / "run"


@pytest.fixture(scope="module")
def other_dataset(tmp_path_factory):
    """Another play, so another number of windows than `dataset`."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "bad_input_other", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", sorted(shakespeare_files())[1],
         "--output", out / "ds2", "--tokenizer", "bytes", "--no-progress"], check=True, timeout=120)) / "ds2"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, trained):
    """The trained run exported as a Hugging Face GPT-2 folder (TINY_TRAIN's model, vocab 257):
    what the init.from rows start from."""
    return shared_dir(tmp_path_factory, "bad_input_hf", lambda out: run_cmd(
        [sys.executable, "-m", "hpctrain", "export", "--checkpoint", trained[1], "--output", out / "gpt2"],
        check=True, timeout=180)) / "gpt2"


class Setup:
    """What a row may use: a temp dir, the module's dataset and trained run (copied before use),
    the run as a Hugging Face folder."""

    def __init__(self, tmp: Path, dataset: Path, trained, other: Path, hf: Path | None = None):
        self.tmp, self.dataset, self.other, self._hf = tmp, dataset, other, hf
        self.cfg, self._run = trained

    def run_copy(self) -> Path:
        run = self.tmp / "run"
        shutil.copytree(self._run, run)
        return run

    def train_args(self, *overrides, run: Path | None = None) -> list:
        return ["hpctrain", "train", "--config", self.cfg, f"--run.dir={run or self.tmp / 'new-run'}",
                *overrides]


def config_row(*overrides, key):
    """A train command with a bad override: refused before anything is written."""
    def row(s: Setup):
        return s.train_args("--train.steps=4", *overrides), s.tmp, [key]
    row.__name__ = "_".join(o.strip("-").replace("train.", "").replace("model.", "") for o in overrides)
    return row


def hf_copy(s: Setup) -> Path:
    folder = s.tmp / "hf"
    shutil.copytree(s._hf, folder)
    return folder


def init_from_row(name: str, damage):
    """`train --init.from` of the exported folder damaged by `damage(folder)`, which returns
    what the error line names; the TOML has no [model] (config.json gives it)."""
    def row(s: Setup):
        folder = hf_copy(s)
        named = damage(folder)
        cfg = s.tmp / "init.toml"
        cfg.write_text(TINY_TRAIN.replace(TINY_MODEL, "").format(run=s.tmp / "new-run",
                                                                 data=s.dataset, steps=2))
        return ["hpctrain", "train", "--config", cfg, f"--init.from={folder}"], folder, named
    row.__name__ = name
    return row


def _extra_tensor(folder):
    edit_weights(folder, lambda t: t.__setitem__("evil.extra", t["transformer.ln_f.bias"].clone()))
    return ["'evil.extra'", str(folder / "model.safetensors")]


def _index_outside(folder):
    (folder.parent / "outside").mkdir()
    shutil.move(folder / "model.safetensors", folder.parent / "outside" / "secret.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "transformer.wte.weight": "../outside/secret.safetensors"}}))
    return ["model.safetensors.index.json", "'transformer.wte.weight'", "../outside/secret.safetensors"]


def _truncated(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])
    return [str(weights)]


def _config_field(field, value):
    def damage(folder):
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
        return [str(folder / "config.json"), f"'{field}'"]
    return damage


def _layers_1e9(folder):
    _config_field("n_layer", 10**9)(folder)
    return ["'model.n_layer'", str(folder / "config.json")]


def _nan_weight(folder):
    edit_weights(folder, lambda t: t["transformer.h.0.mlp.c_fc.weight"].__setitem__((3, 4), float("nan")))
    return ["'transformer.h.0.mlp.c_fc.weight'", str(folder / "model.safetensors")]


def poison(ckpt: Path, fqn: str) -> None:
    """One value of checkpoint tensor `fqn` set to NaN in its .distcp file, the file's xxh3 in
    COMMIT.json recomputed (an intact checkpoint, as a tool other than `train` could save it)."""
    import torch

    from hpctrain.checkpoint import CheckpointManager, disk_format
    from hpctrain.checkpoint.safe_load import read_metadata

    meta = read_metadata(ckpt / ".metadata").state_dict_metadata[fqn]
    state = {"model": {fqn.split(".", 1)[1]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}}
    CheckpointManager(ckpt.parent, keep=9, rank=0, world_size=1).load(ckpt, state)
    values = next(iter(state["model"].values())).numpy().tobytes()
    for data_file in sorted(ckpt.glob("*.distcp")):
        data = bytearray(data_file.read_bytes())
        at = data.find(values)
        if at >= 0:
            data[at:at + 4] = struct.pack("<f", float("nan"))
            data_file.write_bytes(bytes(data))
            commit = json.loads((ckpt / "COMMIT.json").read_text())
            commit["files"][data_file.name][disk_format.DATA_HASH] = disk_format.hash_file(
                data_file, disk_format.DATA_HASH)
            (ckpt / "COMMIT.json").write_text(json.dumps(commit))
            return
    raise AssertionError(f"{fqn}'s bytes not found in {ckpt}")


def resume_a_checkpoint_with_nan_weights(s: Setup):
    run = s.run_copy()
    ckpt = run / "checkpoints" / "step_00000002"
    poison(ckpt, "model.blocks.0.mlp.fc.weight")
    return s.train_args("--train.steps=4", run=run), run, [str(ckpt), "'model.blocks.0.mlp.fc.weight'"]


def micro_batch_larger_than_the_data(s: Setup):
    return s.train_args("--train.micro_batch_size=100000"), s.dataset, ["train.micro_batch_size"]


def toml_not_utf8(s: Setup):
    bad = s.tmp / "latin1.toml"
    bad.write_bytes(Path(s.cfg).read_bytes() + "# caf\u00e9\n".encode("latin-1"))
    return ["hpctrain", "train", "--config", bad], s.dataset, [str(bad), "UTF-8"]


def resume_on_another_dataset(s: Setup):
    run = s.run_copy()
    return (s.train_args("--train.steps=4", f"--data.path={s.other}", run=run), run,
            ["data.path", str(s.other), str(s.dataset)])


def rewrite_state(ckpt: Path, edit):
    """Checkpoint `ckpt`'s trainer_state.json edited by `edit(state)` (returned) and its sha256
    and size in COMMIT.json recomputed, so only the state's own check can refuse it."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    key = edit(state)
    data = json.dumps(state).encode()
    (ckpt / "trainer_state.json").write_bytes(data)
    commit = json.loads((ckpt / "COMMIT.json").read_text())
    commit["files"]["trainer_state.json"] = {"size": len(data),
                                             "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "COMMIT.json").write_text(json.dumps(commit))
    return key


def edited_state(name: str, edit):
    """The trained checkpoint with trainer_state.json edited (rewrite_state)."""
    def row(s: Setup):
        run = s.run_copy()
        key = rewrite_state(run / "checkpoints" / "step_00000002", edit)
        # the one error line names the run's checkpoints (none can be resumed); the warning
        # above it names the file and the key
        return s.train_args("--train.steps=4", run=run), run, [str(run / "checkpoints")], \
            ["trainer_state.json", key]
    row.__name__ = name
    return row


def _set(entry, key, value):
    def edit(state):
        state[entry][key] = value
        return f"{entry}.{key}"
    return edit


def _drop(entry, key=None):
    def edit(state):
        if key:
            del state[entry][key]
            return f"{entry}.{key}"
        del state[entry]
        return entry
    return edit


def sample_row(flag, value):
    def row(s: Setup):
        return ["hpctrain", "sample", "--checkpoint", s._run, flag, value], s._run, [flag]
    row.__name__ = f"sample{flag}_{value}".replace("-", "_")
    return row


def export_into_a_folder_with_files(s: Setup):
    out = s.tmp / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("my notes\n")
    return (["hpctrain", "export", "--checkpoint", s._run, "--format", "hf", "--output", out], out,
            [str(out), "--force"])


ROWS = [config_row("--train.lr=-1", key="train.lr"),
        config_row("--train.lr=nan", key="train.lr"),
        config_row("--train.lr=inf", key="train.lr"),
        config_row("--train.lr=1e30", key="train.lr"),
        config_row("--model.n_embd=0", key="model.n_embd"),
        config_row("--train.beta2=1.5", key="train.beta2"),
        config_row("--train.eval_interval=-1", key="train.eval_interval"),
        config_row("--train.grad_clip=-1", key="train.grad_clip"),
        config_row("--train.min_lr=-1", key="train.min_lr"),
        config_row("--dist.timeout_s=inf", key="dist.timeout_s"),
        # #47: trained silently (stripe_size: a warning at the first save on Lustre; snapshot_dir:
        # no snapshots), or a traceback at the first collective (1e300 s)
        config_row("--checkpoint.stripe_size=abc", key="checkpoint.stripe_size"),
        config_row("--checkpoint.snapshot_dir=", key="checkpoint.snapshot_dir"),
        config_row("--dist.heartbeat_timeout_s=1e300", key="dist.heartbeat_timeout_s"),
        config_row("--dist.timeout_s=1e300", key="dist.timeout_s"),
        micro_batch_larger_than_the_data, toml_not_utf8, resume_on_another_dataset,
        edited_state("state_step_abc", _set("trainer", "step", "abc")),
        edited_state("state_step_negative", _set("trainer", "step", -5)),
        edited_state("state_position_past_the_data", _set("sampler", "position", 10**12)),
        edited_state("state_step_not_its_folders", _set("trainer", "step", 1)),
        sample_row("--temperature", "nan"), sample_row("--top-k", "-3"),
        sample_row("--tokens", "-5"), sample_row("--top-p", "1.5"), sample_row("--top-p", "0"),
        sample_row("--repetition-penalty", "0"), sample_row("--repetition-penalty", "nan"),
        sample_row("--device", "gpu0"), export_into_a_folder_with_files,
        # #47: a model no job could hold (a typo), init.from folders that are not the model their
        # config.json describes, NaN / inf weights in init.from's folder and in a resumed checkpoint
        config_row("--model.n_layer=1000000000", key="model.n_layer"),
        init_from_row("init_from_config_json_n_layer_1e9", _layers_1e9),
        init_from_row("init_from_config_json_n_head_0", _config_field("n_head", 0)),
        init_from_row("init_from_extra_tensor", _extra_tensor),
        init_from_row("init_from_index_entry_outside", _index_outside),
        init_from_row("init_from_truncated_weights", _truncated),
        init_from_row("init_from_nan_weight", _nan_weight),
        resume_a_checkpoint_with_nan_weights]


@pytest.mark.parametrize("row", ROWS, ids=[r.__name__ for r in ROWS])
def test_bad_input_is_one_line_naming_it(tmp_path, dataset, trained, other_dataset, hf_folder, row):  # noqa: F811
    args, watched, named, *also = row(Setup(tmp_path, dataset, trained, other_dataset, hf_folder))
    watched.mkdir(parents=True, exist_ok=True)
    before = checksums(watched)
    r = run_cmd([sys.executable, "-m", *map(str, args)], timeout=180)
    lines = [l for l in r.stderr.splitlines() if re.match(r"(\[rank \d+\] )?error: ", l)]
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and all(n in lines[0] for n in named), r.stderr
    assert all(n in r.stderr for n in (also[0] if also else ())), r.stderr
    assert checksums(watched) == before
    assert not (tmp_path / "new-run" / "checkpoints").exists()


def copy_as_step(run: Path, step: int, edit=None) -> Path:
    """The run's step-2 checkpoint copied as step `step` (trainer.step and COMMIT.json's step
    rewritten: an intact checkpoint), its trainer_state.json also edited by `edit`."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / "step_00000002", ckpt)

    def edits(state):
        state["trainer"]["step"] = step
        return edit(state) if edit else None
    rewrite_state(ckpt, edits)
    commit = json.loads((ckpt / "COMMIT.json").read_text())
    (ckpt / "COMMIT.json").write_text(json.dumps({**commit, "step": step}))
    return ckpt


# A sampler entry damaged five ways (before #33: KeyError tracebacks, or refused as another data.path)
DAMAGED_SAMPLER = {"sampler": _drop("sampler"), "sampler.global_batch": _drop("sampler", "global_batch"),
                   "sampler.shuffle": _set("sampler", "shuffle", "zigzag"),
                   "sampler.block_shards": _set("sampler", "block_shards", 0),
                   "sampler.kind": _set("sampler", "kind", "mystery")}


def test_damaged_sampler_entries_fall_back_to_an_intact_checkpoint(tmp_path, dataset, trained,  # noqa: F811
                                                                   other_dataset):
    """Steps 3-7: copies of the step-2 checkpoint, each with its sampler entry damaged one way of
    DAMAGED_SAMPLER: one launch skips each with a warning naming its trainer_state.json and the
    key, and resumes step 2."""
    s = Setup(tmp_path, dataset, trained, other_dataset)
    run = s.run_copy()
    damaged = {key: copy_as_step(run, step, edit)
               for step, (key, edit) in enumerate(DAMAGED_SAMPLER.items(), start=3)}
    r = run_cmd([sys.executable, "-m", *map(str, s.train_args("--train.steps=3", run=run))], timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    skipped = [line for line in r.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == len(damaged), r.stderr
    for key, ckpt in damaged.items():
        assert sum(f"{ckpt}/trainer_state.json: '{key}'" in line for line in skipped) == 1, (key, r.stderr)
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in r.stderr, r.stderr


def test_a_config_change_never_falls_back_to_an_older_checkpoint(tmp_path, dataset, trained,  # noqa: F811
                                                                 other_dataset):
    """Another data.path with two intact checkpoints (steps 3 and 2): one error line naming
    data.path and the newest, exit 2, nothing skipped (every checkpoint of the run would refuse it)."""
    s = Setup(tmp_path, dataset, trained, other_dataset)
    run = s.run_copy()
    newest = copy_as_step(run, 3)
    args = s.train_args("--train.steps=4", f"--data.path={s.other}", run=run)
    r = run_cmd([sys.executable, "-m", *map(str, args)], timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and "skipping" not in r.stderr, r.stderr
    assert len(lines) == 1 and "'data.path'" in lines[0] and str(newest) in lines[0], r.stderr


def test_export_force_replaces_only_its_own_files(tmp_path, trained):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("my notes\n")
    r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", trained[1], "--output",
                 out, "--force"], timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert (out / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize("state, problem", [
    ({"trainer": {"step": 3, "world_size": 2}, "sampler": {"position": 8, "n_samples": 8}}, None),
    ({"trainer": {"step": "3"}}, "'trainer.step' is '3'"),
    ({"trainer": {"step": True}}, "'trainer.step' is True"),
    ({"trainer": {"step": 2.0}}, "'trainer.step' is 2.0"),
    ({"sampler": {"epoch": -1}}, "'sampler.epoch' is -1"),
    ({"sampler": []}, "'sampler' is not a JSON object"),
    ({"sampler": {"position": 9, "n_samples": 8}}, "'sampler.position' 9 is past"),
])
def test_state_problem(state, problem):
    from hpctrain.checkpoint.disk_format import state_problem

    found = state_problem(state)
    assert found == problem if problem is None else found.startswith(problem), found


# What sample / export must not say of a checkpoint they refuse: what to do when *training* (#47:
# "resume from an older one", "use a new run.dir to start afresh")
TRAINING_WORDS = ("resum", "run.dir", "start over", "afresh")


def _refused_checkpoint(run: Path, damage: str) -> Path:
    """Damage the run's only checkpoint one way; returns the path the error line must name."""
    ckpt = run / "checkpoints" / "step_00000002"
    if damage == "state_step_abc":
        rewrite_state(ckpt, _set("trainer", "step", "abc"))
        return ckpt / "trainer_state.json"
    if damage == "uncommitted":
        (ckpt / "COMMIT.json").unlink()
        return run / "checkpoints"
    import torch  # not a checkpoint of `train`: no config, no tokenizer

    from hpctrain.checkpoint import CheckpointManager

    shutil.rmtree(run / "checkpoints")
    CheckpointManager(run / "checkpoints", keep=1, rank=0, world_size=1).save(
        2, {"model": {"w": torch.ones(4)}}, {"step": 2})
    return ckpt / "trainer_state.json"


@pytest.mark.parametrize("damage", ["state_step_abc", "uncommitted", "not_a_training_checkpoint"])
@pytest.mark.parametrize("command", ["sample", "export"])
def test_sample_and_export_of_a_refused_checkpoint_speak_of_themselves(tmp_path, trained, command,
                                                                       damage):
    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    named = _refused_checkpoint(run, damage)
    args = [command, "--checkpoint", run, *(["--output", tmp_path / "out"] if command == "export" else [])]
    r = run_cmd([sys.executable, "-m", "hpctrain", *map(str, args)], timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and str(named) in lines[0], r.stderr
    words = lines[0].replace(str(tmp_path), "")  # the test's name is in its folder's
    assert command in words and not [w for w in TRAINING_WORDS if w in words], lines[0]
    assert not (tmp_path / "out").exists()
