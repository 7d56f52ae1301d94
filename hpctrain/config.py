"""The one source of truth for a run's settings: TOML loading, `--section.key=value` overrides.

Owns: parsing and type coercion into the schema (config_schema.py: every key, its type, default and
meaning; re-exported here); the rules on values live in config_rules.py (`validate`, run by `from_dict`).
Unknown keys, missing required keys and ill-typed values are `ConfigError`s naming the key. It must
never import torch or touch the filesystem beyond reading the TOML file.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from hpctrain.config_schema import (  # noqa: F401 - the sections are re-exported from here
    REQUIRED, CheckpointConfig, Config, DataConfig, DistConfig, ModelConfig, ParallelConfig,
    EvalSetConfig, RunConfig, SlurmConfig, SyncConfig, TrainConfig, choices, coerce, sections,
    table_lists, type_name)
from hpctrain import logs
from hpctrain.config_rules import validate
from hpctrain.config_tables import describe_table_lists, parse_table_list, table_list_toml
from hpctrain.errors import ConfigError
from hpctrain.step_faults import ENV as TEST_FAULTS_ENV


# Spellings accepted for a key: TOML `async` is a Python keyword, so the field is `async_save`.
ALIASES = {"checkpoint.async": "async_save", "init.from": "from_dir"}
# The name --help, the docs and errors use where it is not the field's (`from` is a Python keyword)
SHOWN = {"init.from_dir": "init.from"}
# keys that moved to another section: named in the error (run dirs written before the move hold them)
MOVED = {"dist.grad_sync": "dist.grad_allreduce"}  # 'sync' is the [sync] section's word
# The test-only faults, once config keys (the [debug] section, before it these four), are no config
# at all now: the environment variable of hpctrain/step_faults.py. Each is an error naming it.
TEST_FAULT_KEYS = {"train.debug_delay_rank": "delay_rank", "train.debug_delay_s": "delay_s",
                   "train.inject_nan_at_step": "inject_nan_at_step",
                   "slurm.debug_step_sleep_s": "step_sleep_s"}
GONE_SECTION = "debug"


def _test_faults_hint(faults: dict) -> str:
    """How the given test-only faults are set now."""
    items = ",".join(f"{k}={v}" for k, v in faults.items())
    return (f": test-only faults are no config (the [{GONE_SECTION}] section is gone): set "
            f"{TEST_FAULTS_ENV}=\"{items}\" in the environment (hpctrain/step_faults.py)")


def _unknown_key(section: str, key: str, value, where: str) -> ConfigError:
    name = f"{section}.{key}"
    if name in TEST_FAULT_KEYS:
        hint = _test_faults_hint({TEST_FAULT_KEYS[name]: value})
    else:
        hint = f": it is now '{MOVED[name]}'" if name in MOVED else _did_you_mean(section, key)
    return ConfigError(f"unknown config key '{name}' {where}{hint}")


def section_keys(section: str) -> list[str]:
    """The keys a section accepts: its fields and their other spellings (ALIASES)."""
    by_name = sections()
    if section not in by_name:
        return []
    return ([f.name for f in dataclasses.fields(by_name[section])]
            + [alias.partition(".")[2] for alias in ALIASES if alias.startswith(f"{section}.")])


def _did_you_mean(section: str, key: str) -> str:
    """' (did you mean SECTION.KEY?)': the section's key nearest to an unknown one (difflib), else
    the same key in another section; '' when none is near."""
    near = difflib.get_close_matches(key, section_keys(section), n=1)
    if near:
        return f" (did you mean {section}.{near[0]}?)"
    elsewhere = [f"{other}.{key}" for other in sections() if key in section_keys(other)]
    return f" (did you mean {elsewhere[0]}?)" if elsewhere else ""


def _clamp_default_warmup(raw: dict, train: TrainConfig) -> TrainConfig:
    """train.warmup_steps not given (its default) but longer than train.steps: warm up over every
    step instead, said once; one the user gave stays as given (config_rules refuses it)."""
    given = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    if "warmup_steps" in given or not 1 <= train.steps < train.warmup_steps:
        return train
    logs.info(f"train.warmup_steps: {train.warmup_steps} > train.steps={train.steps}, using "
              f"{train.steps} (the default warmup; set train.warmup_steps to choose)")
    return dataclasses.replace(train, warmup_steps=train.steps)


# Sections of a training TOML that are not training settings: [tune] is `hpctrain tune`'s search
# space (hpctrain/tune/space.py); `from_dict` checks it and leaves it out of the Config.
OTHER_SECTIONS = ("tune",)


def from_dict(raw: dict, source: str = "config", cli_keys: frozenset = frozenset()) -> Config:
    by_name = sections()
    built = {}
    if "tune" in raw:
        from hpctrain.tune.space import parse  # no torch, no optuna: only the schema

        parse(raw["tune"], source, str(raw.get("run", {}).get("dir", "")), cli_keys)
    for name in raw:
        if name in OTHER_SECTIONS or name in table_lists():
            continue
        if name not in by_name:
            where = "on the command line" if any(k.startswith(f"{name}.") for k in cli_keys) else f"in {source}"
            if name == GONE_SECTION and isinstance(raw[name], dict):
                raise ConfigError(f"unknown config section '{name}' {where}{_test_faults_hint(raw[name])}")
            known = ", ".join([*by_name, *table_lists(), *OTHER_SECTIONS])
            raise ConfigError(f"unknown config section '{name}' {where} (known: {known})")
    if isinstance(raw.get("init"), dict) and (raw["init"].get("from") or raw["init"].get("from_dir")):
        from hpctrain.interop.hf_import import fill_model_section  # [model] from its config.json

        raw = fill_model_section(raw, lambda key, value, like: coerce(key, value, type(like)))
    raw = _flatten_moe_table(raw, source, cli_keys)
    for name, cls in by_name.items():
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"config key '{name}': expected a [{name}] table in {source}")
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            key = ALIASES.get(f"{name}.{key}", key)
            if key not in known:
                where = "on the command line" if f"{name}.{key}" in cli_keys else f"in {source}"
                raise _unknown_key(name, key, value, where)
            kwargs[key] = coerce(SHOWN.get(f"{name}.{key}", f"{name}.{key}"), value, hints[key])
        for key, f in known.items():
            if key not in kwargs and f.default is REQUIRED and f.default_factory is REQUIRED:
                raise ConfigError(_missing_key(f"{name}.{key}", source, by_name))
        built[name] = cls(**kwargs)
    for name in table_lists():  # [[eval]] ...: lists of tables
        built[name] = parse_table_list(name, raw.get(name, []), source, cli_keys)
    built["train"] = _clamp_default_warmup(raw, built["train"])
    return validate(Config(**built))


def _flatten_moe_table(raw: dict, source: str, cli_keys: frozenset) -> dict:
    """A [model.moe] table (experts = 8, top_k = 2, ...) as the [model] keys moe_experts, ...
    (a --model.moe_KEY override wins over the table's KEY)."""
    model = raw.get("model")
    if not isinstance(model, dict) or "moe" not in model:
        return raw
    if not isinstance(model["moe"], dict):
        raise ConfigError(f"config key 'model.moe': expected a [model.moe] table in {source}")
    flat = {k: v for k, v in model.items() if k != "moe"}
    for key, value in model["moe"].items():
        if f"model.moe_{key}" in cli_keys:
            continue
        if f"moe_{key}" in flat:
            raise ConfigError(f"config key 'model.moe.{key}': given twice in {source} (also as model.moe_{key})")
        flat[f"moe_{key}"] = value
    return {**raw, "model": flat}


def _missing_key(key: str, source: str, sections: dict) -> str:
    """A required key is missing: from the file, or (no --config given) from the command line."""
    if source != "overrides":
        return f"missing required config key '{key}' in {source}"
    required = [f"--{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls)
                if f.default is REQUIRED and f.default_factory is REQUIRED]
    return (f"missing required config key '{key}': no --config FILE given; pass --config (a TOML "
            f"file, e.g. configs/*.toml) or give the required keys {', '.join(required)}")


def parse_overrides(args: list[str]) -> dict:
    """['--train.steps=40', '--run.dir', 'x'] -> {'train': {'steps': '40'}, 'run': {'dir': 'x'}}."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"bad override {arg!r}: expected --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
        i += 1
    return out


def load(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    return from_dict(*read_raw(path, overrides))


def read_raw(path: str | Path | None, overrides: list[str] | None = None
             ) -> tuple[dict, str, frozenset]:
    """(the TOML with the overrides merged in, its name for errors, the keys given as overrides)."""
    raw: dict = {}
    source = "overrides"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); "
                              f"a TOML config must be UTF-8") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
    cli_keys = set()
    for section, values in parse_overrides(overrides or []).items():
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config key '{section}': not a table")
        raw[section].update(values)
        cli_keys.update(f"{section}.{key}" for key in values)
    return raw, source, frozenset(cli_keys)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"'}


def toml_string(text: str) -> str:
    """A TOML basic string: the backslash, the quote and every control character escaped."""
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value) -> str:
    """One TOML value that tomllib reads back as `value` (str, bool, int, float, list of those)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(cfg: Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        if section in table_lists():
            lines.extend(table_list_toml(section, getattr(cfg, section), toml_value))
            continue
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every option with its type, default and meaning, for `--help`."""
    out = []
    for section, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not REQUIRED:
                default = repr(f.default)
            elif f.default_factory is not REQUIRED:
                default = repr(f.default_factory())
            else:
                default = "required"
            name = SHOWN.get(f"{section}.{f.name}", f"{section}.{f.name}")
            spellings = [f"{section}.{f.name}"] + [alias for alias, field in ALIASES.items()
                                                   if alias.startswith(f"{section}.") and field == f.name]
            others = [f"--{k}" for k in spellings if k != name]
            also = f" (also spelled {', '.join(others)})" if others else ""
            out.append(f"  --{name}={type_name(hints[f.name]):<6} [{default}] {f.metadata.get('help', '')}{also}")
    return "\n".join(out + describe_table_lists())
