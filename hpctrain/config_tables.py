"""Lists of tables in a run's config (`[[eval]]`): reading them, writing them back, their --help
lines and their rules.

Owns: a `[[name]]` list of tables (config_schema.table_lists: name -> the class of one table) into
a list of that class, each key coerced like a [section] key and every error naming `name[i].key`;
the TOML and --help text of such a list; the rules on [[eval]] values. config.py calls these. It
must never import torch or touch the filesystem.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing

from hpctrain.config_schema import REQUIRED, Config, table_lists, type_name
from hpctrain.config_values import coerce
from hpctrain.errors import ConfigError

EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a metric key's part: eval/<name>/loss


def parse_table_list(name: str, value, source: str, cli_keys: frozenset) -> list:
    """`[[name]]` tables (a list of dicts) as a list of the table class; ConfigError naming
    `name[i].key` for an unknown, missing or ill-typed key."""
    if any(key.startswith(f"{name}.") for key in cli_keys):
        raise ConfigError(f"config key '{name}': [[{name}]] tables are set in the TOML file only "
                          f"(no --{name}.KEY override)")
    cls = table_lists()[name]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"config key '{name}': expected [[{name}]] tables (a list of tables) in {source}")
    return [_one_table(f"{name}[{i}]", cls, item, source) for i, item in enumerate(value)]


def _one_table(where: str, cls: type, values: dict, source: str):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {where}.{near[0]}?)" if near else f" (known: {', '.join(known)})"
            raise ConfigError(f"unknown config key '{where}.{key}' in {source}{hint}")
        kwargs[key] = coerce(f"{where}.{key}", value, hints[key])
    for key, f in known.items():
        if key not in kwargs and f.default is REQUIRED and f.default_factory is REQUIRED:
            raise ConfigError(f"missing required config key '{where}.{key}' in {source}")
    return cls(**kwargs)


def table_list_toml(name: str, items: list, toml_value) -> list[str]:
    """The TOML lines of a [[name]] list (`toml_value`: config.toml_value), one table each."""
    lines = []
    for item in items:
        lines.append(f"[[{name}]]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in dataclasses.asdict(item).items())
        lines.append("")
    return lines


def describe_table_lists() -> list[str]:
    """--help lines of every [[name]] table's keys, as `[[name]] key=TYPE [default] help`."""
    out = []
    for name, cls in table_lists().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = "required" if f.default is REQUIRED else repr(f.default)
            out.append(f"  [[{name}]] {f.name}={type_name(hints[f.name]):<6} [{default}] "
                       f"{f.metadata.get('help', '')}")
    return out


def validate_eval_sets(cfg: Config) -> None:
    """The rules on the [[eval]] tables; ConfigError naming `eval[i].key`."""
    if cfg.eval and cfg.sync.mode in ("ps", "async_diloco"):
        raise ConfigError(f"config key 'eval': [[eval]] sets need steps every rank takes together; "
                          f"sync.mode = {cfg.sync.mode!r} steps apart (remove the tables)")
    seen = set()
    for i, e in enumerate(cfg.eval):
        where = f"eval[{i}]"
        if not EVAL_NAME.fullmatch(e.name):
            raise ConfigError(f"config key '{where}.name': {e.name!r}: use letters, digits, '_', '-' "
                              f"or '.' (it names the metrics eval/<name>/loss)")
        if e.name in seen:
            raise ConfigError(f"config key '{where}.name': {e.name!r} is the name of an earlier "
                              f"[[eval]] table; give each set its own name")
        seen.add(e.name)
        if not e.data:
            raise ConfigError(f"config key '{where}.data': empty; give a dataset directory "
                              f"made by `data_tools shard`")
        for key in ("interval", "max_batches", "max_tokens"):
            if getattr(e, key) < 0:
                raise ConfigError(f"config key '{where}.{key}': {getattr(e, key)}: must be >= 0")
        if not (e.interval or cfg.train.eval_interval):
            raise ConfigError(f"config key '{where}.interval': 0 with train.eval_interval = 0: the "
                              f"set would never be evaluated; set {where}.interval to N steps")
