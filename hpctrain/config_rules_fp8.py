"""The rules of train.precision = "fp8" and the [fp8] section that need no device: what torchao's
float8 training supports here, each a one-line `ConfigError` naming the key
(config_rules.validate calls `validate_fp8`; the device's own refusal is parallel/float8.py's).

Owns: these checks. It must never import torch or look at anything but the config's values.
"""
from __future__ import annotations

from typing import Callable

from hpctrain.config_schema import Config

Check = Callable[[bool, str, str], None]


def validate_fp8(cfg: Config, check: Check) -> None:
    f = cfg.fp8
    check(not f.fsdp_all_gather or f.recipe == "tensorwise", "fp8.fsdp_all_gather",
          f"true with fp8.recipe = {f.recipe!r}: torchao all-gathers float8 weights with the "
          f"tensorwise recipe only; set it to false or fp8.recipe = 'tensorwise'")
    if cfg.train.precision != "fp8":
        return
    check(cfg.parallel.tp == 1, "parallel.tp",
          f"{cfg.parallel.tp} with train.precision = 'fp8': float8 under tensor parallelism is not "
          f"wired yet; use parallel.tp = 1 or train.precision = 'bf16'")
    check(not (f.emulate and cfg.train.compile), "fp8.emulate",
          "true with train.compile = true: torchao's emulated float8 runs eager only; set "
          "train.compile = false")
