"""The rules of CPU offload (parallel.offload; hpctrain/parallel/offload.py) that need no world
size, each a one-line `ConfigError` naming the key (config_rules.validate calls `validate_offload`).
"all" without FSDP2 over more than one rank is refused where the layout is applied (parallelize.py).

Owns: these checks. It must never import torch or look at anything but the config's values.
"""
from __future__ import annotations

from typing import Callable

from hpctrain.config_schema import Config

Check = Callable[[bool, str, str], None]


def validate_offload(cfg: Config, check: Check) -> None:
    p, t = cfg.parallel, cfg.train
    check(p.offload != "all" or p.data_parallel == "fsdp", "parallel.offload",
          "'all' is FSDP2's CPU offload: set parallel.data_parallel = 'fsdp', or use 'optimizer'")
    check(p.offload != "optimizer" or t.optimizer == "adamw", "parallel.offload",
          f"'optimizer' offloads AdamW (train.optimizer = {t.optimizer!r}): use 'none'")
    check(p.offload == "none" or cfg.sync.mode == "sync", "parallel.offload",
          f"{p.offload!r} with sync.mode = {cfg.sync.mode!r}, whose outer steps rewrite the weights "
          f"between steps (not built for host-memory copies): use 'none'")
