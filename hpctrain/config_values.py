"""A config value into its key's type: `coerce` (which every parser of TOML tables and
`--section.key=value` overrides uses), and the choices of a Literal key. Part of config_schema.py,
which re-exports them. It must never import torch or read files.
"""
from __future__ import annotations

import math
import typing
from typing import Literal

from hpctrain.errors import ConfigError

INT_MIN, INT_MAX = -2**63, 2**63 - 1  # every int key: a TOML integer (64-bit signed)


def coerce(key: str, value, typ: type):
    """Convert a TOML value or an override string to the field's type, or raise naming the key."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = int(value)
            except ValueError:
                pass
        if number is not None and not INT_MIN <= number <= INT_MAX:  # TOML's and torch's integers
            raise ConfigError(f"config key '{key}': {value!r} is out of range (a 64-bit integer)")
        if number is not None:
            return number
    elif typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):  # no key means nan or inf
            raise ConfigError(f"config key '{key}': {value!r} is not a finite number")
        if number is not None:
            return number
    elif typ is str:
        if isinstance(value, str):
            return value
    elif choices(typ):
        text = ("true" if value else "false") if isinstance(value, bool) else value  # `requeue = true`
        if isinstance(text, str) and text in choices(typ):
            return text
        raise ConfigError(f"config key '{key}': {value!r}: expected one of {', '.join(choices(typ))}")
    raise ConfigError(f"config key '{key}': expected {type_name(typ)}, got {value!r}")


def choices(typ) -> tuple[str, ...]:
    """The allowed values of a Literal[...] field (the one declaration --help and parsing read)."""
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def key_choices(section: type, key: str) -> tuple[str, ...]:
    """The allowed values of one Literal key of a section, e.g. (SyncConfig, "compression")."""
    return choices(typing.get_type_hints(section)[key])


def type_name(typ) -> str:
    return "|".join(choices(typ)) if choices(typ) else typ.__name__
