"""Config: TOML + overrides -> dataclasses; every bad input is one ConfigError naming the key."""
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from tests.conftest import model_section

MINIMAL = """
[run]
dir = "runs/x"
[data]
path = "data/x"
""" + model_section(n_embd=32, block_size=16) + """[train]
steps = 10
micro_batch_size = 4
"""


@pytest.fixture
def toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL)
    return p


def test_load_defaults_and_overrides(toml):
    cfg = config.load(toml, ["--train.steps=40", "--train.lr", "3e-4", "--train.precision=bf16",
                             "--checkpoint.keep=5"])
    assert cfg.train.steps == 40 and cfg.train.lr == 3e-4 and cfg.train.precision == "bf16"
    assert cfg.checkpoint.keep == 5 and cfg.train.grad_accum == 1
    assert cfg.checkpoint_dir == Path("runs/x/checkpoints")


def test_roundtrip_through_toml(toml, tmp_path):
    cfg = config.load(toml, ["--train.stop_at_step=5"])
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml(cfg))
    assert config.load(again) == cfg


@pytest.mark.parametrize("run_dir", ['runs/a"b', "runs\\x\\y", "runs/tab\there", "runs/ünï €", "runs/\x7f\x01"])
def test_roundtrip_escapes_strings(toml, tmp_path, run_dir):
    """A run.dir with a quote, backslash, control character or non-ASCII text wrote a config.toml
    that tomllib could not read (unescaped basic string): now it reads back equal."""
    cfg = config.load(toml, [f"--run.dir={run_dir}"])
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml(cfg), encoding="utf-8")
    assert config.load(again).run.dir == cfg.run.dir == run_dir


@pytest.mark.parametrize("overrides, key", [
    (["--train.stepz=3"], "train.stepz"),
    (["--bogus.x=1"], "bogus"),
    (["--train.steps=abc"], "train.steps"),
    (["--train.lr=fast"], "train.lr"),
    (["--train.precision=fp4"], "train.precision"),
    (["--model.n_head=3"], "model.n_head"),
    (["--train.stop_at_step=11"], "train.stop_at_step"),
    (["train.steps=3"], "train.steps=3"),
    (["--sync.mode=gossip"], "sync.mode"),
    (["--sync.inner_steps=4", "--sync.fragments=5"], "sync.fragments"),
    (["--sync.compression=int4"], "sync.compression"),
    (["--sync.compression=int8"], "sync.compression"),  # sync.mode = 'ddp' would ignore it
    (["--sync.mode=ps", "--sync.compression=bf16"], "sync.compression"),
    (["--sync.streaming=true"], "sync.streaming"),  # sync.mode = 'sync': not a DiLoCo
    (["--sync.mode=diloco", "--sync.inner_steps=4", "--sync.fragments=2",
      "--sync.overlap_steps=3"], "sync.overlap_steps"),  # > H / P: two fragments in flight
    (["--sync.mix_alpha=1"], "sync.mix_alpha"),
    (["--sync.mode=diloco", "--sync.compression=int4", "--sync.error_feedback=true"],
     "sync.error_feedback"),  # plain DiLoCo: residuals are Streaming DiLoCo's
    (["--sync.outer_momentum=1.0"], "sync.outer_momentum"),
    (["--sync.mode=diloco", "--sync.outer_final_lr=-0.1"], "sync.outer_final_lr"),
    (["--sync.mode=async_diloco", "--sync.outer_final_lr=0.3"], "sync.outer_final_lr"),  # ignored there
    (["--sync.outer_final_lr=0.3"], "sync.outer_final_lr"),  # sync.mode = 'sync': no outer step
    (["--train.nesterov=true"], "train.nesterov"),  # AdamW: no such momentum
    (["--sync.momentum_per_lr=true"], "sync.momentum_per_lr"),  # not async_diloco
    (["--sync.mode=async_diloco", "--sync.pull_compression=int4"], "sync.pull_compression"),  # no compression
    (["--sync.mode=async_diloco", "--sync.compression=int8", "--sync.outer_optimizer=sgd",
      "--sync.defer_momentum_pull=true"], "sync.defer_momentum_pull"),  # no momentum step to defer
    (["--sync.staleness=-2"], "sync.staleness"),
    (["--sync.mode=diloco", "--parallel.data_parallel=fsdp"], "parallel.data_parallel"),
    (["--sync.mode=async_diloco", "--parallel.data_parallel=fsdp"], "parallel.data_parallel"),  # flat
    (["--sync.mode=ps", "--parallel.tp=2"], "sync.mode"),
    (["--train.optimizer=lion"], "train.optimizer"),
    (["--dist.grad_allreduce=topk"], "dist.grad_allreduce"),
    (["--checkpoint.async_cpu_share=0"], "checkpoint.async_cpu_share"),
    (["--checkpoint.async_cpu_share=1.5"], "checkpoint.async_cpu_share"),
    (["--train.lr=-1"], "train.lr"),
    (["--train.lr=0"], "train.lr"),
    (["--train.lr=11"], "train.lr"),  # above MAX_LR: a typo such as 3e3 for 3e-3
    (["--train.min_lr=-1e-4"], "train.min_lr"),
    (["--train.beta1=1"], "train.beta1"),
    (["--train.beta2=1.5"], "train.beta2"),
    (["--train.weight_decay=-0.1"], "train.weight_decay"),
    (["--train.grad_clip=-1"], "train.grad_clip"),
    (["--train.eval_interval=-1"], "train.eval_interval"),
    (["--train.eval_batches=0"], "train.eval_batches"),
    (["--train.log_interval=0"], "train.log_interval"),
    (["--train.seed=-1"], "train.seed"),
    (["--model.n_embd=0"], "model.n_embd"),
    (["--model.vocab_size=0"], "model.vocab_size"),
    (["--dist.timeout_s=0"], "dist.timeout_s"),
    (["--train.compile_scope=model", "--parallel.data_parallel=fsdp"], "train.compile_scope"),
    (["--train.compile_scope=model", "--parallel.tp=2"], "train.compile_scope"),
    (["--train.compile_scope=layer"], "train.compile_scope"),
    # #47: accepted silently before
    (["--checkpoint.stripe_size=abc"], "checkpoint.stripe_size"),  # lfs setstripe -S refuses it
    (["--checkpoint.stripe_size=1.5M"], "checkpoint.stripe_size"),
    (["--checkpoint.stripe_size=-1M"], "checkpoint.stripe_size"),
    (["--checkpoint.stripe_size=96k"], "checkpoint.stripe_size"),  # not a multiple of 64k
    (["--checkpoint.stripe_size=4G"], "checkpoint.stripe_size"),  # Lustre's most: 4G - 64k
    (["--checkpoint.stripe_count=-2"], "checkpoint.stripe_count"),
    (["--checkpoint.stripe_count=2001"], "checkpoint.stripe_count"),
    (["--checkpoint.snapshot_dir="], "checkpoint.snapshot_dir"),  # silently no snapshots before
    (["--checkpoint.snapshot_dir=  "], "checkpoint.snapshot_dir"),
    (["--dist.heartbeat_timeout_s=1e300"], "dist.heartbeat_timeout_s"),  # a traceback at start
    (["--dist.heartbeat_timeout_s=-1"], "dist.heartbeat_timeout_s"),
    (["--dist.heartbeat_timeout_s=0.5"], "dist.heartbeat_timeout_s"),
    (["--dist.heartbeat_timeout_s=86401"], "dist.heartbeat_timeout_s"),
    (["--train.seed=4294967296"], "train.seed"),
    (["--train.seed=99999999999999999999999"], "train.seed"),  # torch.manual_seed: a traceback
    (["--checkpoint.interval=9223372036854775808"], "checkpoint.interval"),  # past a TOML integer
])
def test_bad_input_names_the_key(toml, overrides, key):
    with pytest.raises(ConfigError) as e:
        config.load(toml, overrides)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def _float_keys() -> list[str]:
    import dataclasses
    import typing

    return [f"{section}.{f.name}" for section, cls in config.sections().items()
            for f in dataclasses.fields(cls) if typing.get_type_hints(cls)[f.name] is float]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_non_finite_values(toml, value):
    keys = _float_keys()
    assert len(keys) >= 20 and "train.lr" in keys and "sync.outer_lr" in keys
    for key in keys:
        with pytest.raises(ConfigError, match=f"^config key '{key}': '{value}' is not a finite"):
            config.load(toml, [f"--{key}={value}"])


def _seconds_keys() -> list[str]:
    return [key for key in _float_keys() if key.endswith("_s")]


@pytest.mark.parametrize("value, words", [("1e300", "at most 604800"), ("604801", "at most 604800"),
                                          ("-1", ""), ("-1e-9", "")])  # each key's own lower bound
def test_every_seconds_key_is_bounded(toml, value, words):
    """Generic over every float key in seconds (a new one is covered): 1e300 overflowed the first
    collective's timedelta with a traceback (dist.timeout_s, dist.heartbeat_timeout_s) or was kept
    (slurm.time_check_s); one line naming the key and the bound."""
    keys = _seconds_keys()
    assert {"dist.timeout_s", "dist.heartbeat_timeout_s", "dist.stall_timeout_s",
            "slurm.time_margin_s", "slurm.time_check_s"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError, match=f"^config key '{key}': ") as e:
            config.load(toml, [f"--{key}={value}"])
        assert "\n" not in str(e.value)
        if key != "dist.heartbeat_timeout_s":  # its own range: [1, 86400]
            assert words in str(e.value), str(e.value)


def test_heartbeat_range_is_named(toml):
    with pytest.raises(ConfigError) as e:
        config.load(toml, ["--dist.heartbeat_timeout_s=1e300"])
    assert str(e.value).startswith("config key 'dist.heartbeat_timeout_s': 1e+300:")
    assert "0" in str(e.value) and "[1, 86400]" in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["--checkpoint.stripe_size=1M", "--checkpoint.stripe_count=-1"],
    ["--checkpoint.stripe_size=4m", "--checkpoint.stripe_count=2000"],
    ["--checkpoint.stripe_size=65536"], ["--checkpoint.stripe_size=0"],
    ["--checkpoint.stripe_size=4194240k"],  # 4G - 64k: Lustre's largest
    ["--dist.heartbeat_timeout_s=0", "--dist.timeout_s=604800"],
    ["--dist.heartbeat_timeout_s=1", "--slurm.time_margin_s=0"],
    ["--dist.heartbeat_timeout_s=86400"],
    ["--checkpoint.snapshot_dir=auto"], ["--checkpoint.snapshot_dir=/dev/shm/{node}"],
    ["--train.seed=4294967295"]])
def test_values_at_the_new_bounds_are_accepted(toml, overrides):
    config.load(toml, overrides)


def test_stripe_size_bytes():
    from hpctrain.config_rules import stripe_size_bytes

    assert [stripe_size_bytes(t) for t in ("4M", "1m", "64k", "65536", "0", "1G")] == [
        4 << 20, 1 << 20, 64 << 10, 65536, 0, 1 << 30]
    assert [stripe_size_bytes(t) for t in ("abc", "", "4MB", "1.5M", "-1M", "4G", "100")] == [None] * 7


def test_non_finite_in_the_toml_file(toml):
    toml.write_text(toml.read_text().replace("steps = 10", "steps = 10\nlr = nan"))
    with pytest.raises(ConfigError, match="^config key 'train.lr': nan is not a finite number"):
        config.load(toml)


def test_good_values_at_the_bounds_are_accepted(toml):
    cfg = config.load(toml, ["--train.lr=10", "--train.min_lr=10", "--train.grad_clip=0",
                             "--train.eval_interval=0", "--train.beta2=0", "--train.seed=0"])
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.grad_clip) == (10.0, 10.0, 0.0)


def test_a_min_lr_above_lr_is_taken_as_lr(toml):
    """Accepted (a search over train.lr keeps one min_lr): the rate never rises after warmup."""
    from hpctrain.model.optim import lr_at

    t = config.load(toml, ["--train.lr=1e-5", "--train.min_lr=1e-4", "--train.warmup_steps=2"]).train
    assert [lr_at(s, t) for s in range(t.steps)] == [5e-6] + [1e-5] * 9
    t = config.load(toml, ["--train.warmup_steps=0"]).train  # min_lr below lr: the cosine decays
    assert lr_at(0, t) == 1e-3 and lr_at(9, t) < 2e-4


def test_a_config_that_is_not_utf8_names_the_file(toml):
    toml.write_bytes(toml.read_bytes() + "# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"^{toml}: not UTF-8 text .*0xe9"):
        config.load(toml)


def test_missing_required_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL.replace('path = "data/x"\n', ""))
    with pytest.raises(ConfigError, match="missing required config key 'data.path'"):
        config.load(p)


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL + "bogus_key = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.bogus_key' in .*c.toml"):
        config.load(p)


def test_wrong_type_in_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MINIMAL.replace("steps = 10", 'steps = "ten"'))
    with pytest.raises(ConfigError, match="config key 'train.steps': expected int, got 'ten'"):
        config.load(p)


def test_cli_reports_one_line_and_exit_2(toml):
    r = subprocess.run([sys.executable, "-m", "hpctrain", "train", "--config", str(toml),
                        "--train.nope=1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown config key 'train.nope' on the command line"


def test_help_lists_every_key():
    r = subprocess.run([sys.executable, "-m", "hpctrain", "train", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0
    for key in ("--run.dir", "--data.path", "--model.n_layer", "--train.stop_at_step",
                "--train.precision", "--train.global_batch", "--checkpoint.interval", "--checkpoint.keep",
                "--dist.timeout_s"):
        assert key in r.stdout


def test_an_unknown_override_is_named_as_a_command_line_key(toml):
    """A typo on the command line is not blamed on the TOML file; a renamed key names its new name."""
    with pytest.raises(ConfigError) as e:
        config.load(toml, ["--train.lrr=1"])
    assert str(e.value) == "unknown config key 'train.lrr' on the command line (did you mean train.lr?)"
    with pytest.raises(ConfigError) as e:
        config.load(toml, ["--dist.grad_sync=mpi"])
    assert str(e.value) == ("unknown config key 'dist.grad_sync' on the command line: it is now "
                            "'dist.grad_allreduce'")
    toml.write_text(toml.read_text().replace("[train]", "[train]\nlrr = 1", 1))
    with pytest.raises(ConfigError, match=rf"unknown config key 'train.lrr' in {toml} \(did you mean train.lr\?\)$"):
        config.load(toml, [])


@pytest.mark.parametrize("override, near", [
    ("--train.stpes=3", "train.steps"), ("--train.warmup=3", "train.warmup_steps"),
    ("--model.lr=1e-3", "train.lr"),  # the right key in the wrong section
    ("--checkpoint.asyn=true", "checkpoint.async"), ("--init.frm=x", "init.from"),
    ("--train.nope=1", None), ("--parallel.zzz=1", None)])
def test_an_unknown_key_says_the_nearest_known_one(toml, override, near):
    with pytest.raises(ConfigError) as e:
        config.load(toml, [override])
    key = override[2:].split("=")[0]
    hint = f" (did you mean {near}?)" if near else ""
    assert str(e.value) == f"unknown config key '{key}' on the command line{hint}"


def test_a_default_warmup_longer_than_the_run_is_clamped_once(toml, capsys):
    """`--train.steps=2` alone: the default warmup (10) becomes 2, said in one line; a warmup the
    user gave is theirs: still refused, naming the key and both values."""
    cfg = config.load(toml, ["--train.steps=2"])
    assert (cfg.train.steps, cfg.train.warmup_steps) == (2, 2)
    err = capsys.readouterr().err
    assert err == "train.warmup_steps: 10 > train.steps=2, using 2 (the default warmup; set " \
                  "train.warmup_steps to choose)\n"
    for given in (["--train.warmup_steps=10"], ["--train.warmup_steps", "3"]):
        with pytest.raises(ConfigError) as e:
            config.load(toml, ["--train.steps=2", *given])
        assert str(e.value) == (f"config key 'train.warmup_steps': {given[-1].split('=')[-1]}: must be "
                                f"in [0, train.steps=2]")
    toml.write_text(toml.read_text().replace("steps = 10", "steps = 2\nwarmup_steps = 10"))
    with pytest.raises(ConfigError, match="'train.warmup_steps': 10: must be in"):
        config.load(toml)  # given in the file: as given
    assert config.load(toml, ["--train.steps=12"]).train.warmup_steps == 10
    assert capsys.readouterr().err == ""  # nothing clamped, nothing said


# The words a family goes by in --help and the docs, by Hugging Face model_type (hf_llama.ARCHITECTURES)
FAMILY_WORDS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral",
                "qwen2_moe": "Qwen2-MoE"}


def test_help_and_docs_name_keys_and_families_as_the_code_does(root):
    """--help names init.from and checkpoint.async_save as README and docs/*.md do (the other
    spelling said beside it), and the init.from / export help name every family the code reads /
    writes (export writes no Mistral: a Mistral-shaped model exports as Llama)."""
    import re

    from hpctrain.model.llama.hf import ARCHITECTURES
    keys = config.describe()
    assert "--init.from=str" in keys and "(also spelled --init.from_dir)" in keys
    assert "--checkpoint.async_save=bool" in keys and "(also spelled --checkpoint.async)" in keys
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text()
        assert not re.search(r"checkpoint\.async\b|init\.from_dir|\bfrom_dir\b", text), path
    assert set(FAMILY_WORDS) == set(ARCHITECTURES)
    init_help = next(line for line in keys.splitlines() if line.startswith("  --init.from="))
    r = subprocess.run([sys.executable, "-m", "hpctrain", "export", "--help"], capture_output=True,
                       text=True, timeout=120)
    export_help = " ".join(r.stdout.split())
    for kind, words in FAMILY_WORDS.items():
        assert words in init_help, kind
        assert kind == "mistral" or words in export_help, kind
    assert "GPT-2" in init_help and "GPT-2" in export_help


@pytest.mark.parametrize("requested, device, layout_allows, experts, scope", [
    ("auto", "cuda", True, False, "model"),    # 1 rank / DDP on a GPU: the whole model
    ("auto", "cpu", True, False, "blocks"),    # a CPU: per block (same speed, shorter compile)
    ("auto", "cuda", False, False, "blocks"),  # FSDP2 / TP / PP / EP
    ("auto", "cuda", True, True, "blocks"),    # a mixture of experts
    ("model", "cpu", True, False, "model"),    # said explicitly: as said
    ("blocks", "cuda", True, False, "blocks"),
])
def test_compile_scope_auto_picks_the_whole_model_on_cuda_only(requested, device, layout_allows, experts, scope):
    import torch

    from hpctrain.parallel.activation import compile_scope
    assert compile_scope(requested, torch.device(device), layout_allows, experts) == scope


def test_compile_is_refused_in_one_line_where_inductor_cannot_link(monkeypatch, tmp_path):
    """A torch installed under a path with a space (a clone in "My Projects/"): Inductor's linker
    line splits it (pytorch/pytorch#191010), so train.compile is refused naming the key and the
    folder before any forward; the GPU path and a path without spaces are not refused."""
    import torch

    from hpctrain import config
    from hpctrain.parallel import activation
    from hpctrain.parallel.parallelize import apply_compile
    assert activation.compile_blocked(torch.device("cpu")) is None or " " in torch.__file__
    spaced = tmp_path / "My Projects" / "torch" / "__init__.py"
    monkeypatch.setattr(torch, "__file__", str(spaced))
    line = activation.compile_blocked(torch.device("cpu"))
    assert line and str(spaced.parent / "lib") in line and "191010" in line
    assert activation.compile_blocked(torch.device("cuda")) is None
    cfg = config.load(None, ["--run.dir=r", "--data.path=d", "--model.n_layer=1", "--model.n_head=1",
                             "--model.n_embd=8", "--model.block_size=8", "--model.vocab_size=8",
                             "--train.steps=1", "--train.warmup_steps=0", "--train.micro_batch_size=1",
                             "--train.compile=true"])
    with pytest.raises(ConfigError, match=r"^train\.compile: .*My Projects"):
        apply_compile(torch.nn.Module(), cfg, torch.device("cpu"), plain_or_ddp=True)


LLAMA_TIED = model_section(arch="llama", n_layer=1, n_head=4, n_embd=256, block_size=32, ffn_hidden=512,
                           tie_embeddings=True)


def test_steps_alone_trains_and_the_start_line_counts_params_as_transformers(tmp_path, one_play):
    """`--train.steps=2` with no warmup in the config trains (before: 'train.warmup_steps: must be
    in [0, train.steps]'), saying the clamp once; the start-up line's counts are transformers'
    num_parameters() of the same Llama (tied: the embedding counted once; without embeddings:
    num_parameters(exclude_embeddings=True))."""
    import transformers

    from hpctrain.model.params import params_words
    from tests.conftest import TINY_MODEL, TINY_TRAIN, run_cmd

    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TRAIN.replace("warmup_steps = 0\n", "").replace(TINY_MODEL, LLAMA_TIED).format(
        run=tmp_path / "run", data=one_play, steps=40))
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg, "--train.steps=2"],
                timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("train.warmup_steps: 10 > train.steps=2, using 2") == 1, r.stderr
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=True))
    total, without = hf.num_parameters(), hf.num_parameters(exclude_embeddings=True)
    assert without < total  # the counts differ in the line's 2 decimals: 0.72M vs 0.66M
    assert f"training: {params_words(total, without)}, world 1" in r.stderr, r.stderr
