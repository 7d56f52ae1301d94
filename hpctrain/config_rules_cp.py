"""The rules of context parallelism (parallel.cp, parallel.cp_attention) that need no world size:
what the cp split needs of the model and what it does not support yet, each a one-line
`ConfigError` naming the key (config_rules.validate calls `validate_context_parallel`).

Owns: these checks. It must never import torch or look at anything but the config's values.
"""
from __future__ import annotations

from typing import Callable

from hpctrain.config_schema import Config

Check = Callable[[bool, str, str], None]


def validate_context_parallel(cfg: Config, check: Check) -> None:
    p, m = cfg.parallel, cfg.model
    check(p.cp >= 1, "parallel.cp", f"{p.cp}: must be >= 1")
    if p.cp == 1:
        return
    cp = p.cp
    check(m.block_size % (2 * cp) == 0, "model.block_size",
          f"{m.block_size} is not a multiple of 2 x parallel.cp = {2 * cp} (the zig-zag split cuts "
          f"each sequence into 2 x cp equal chunks)")
    check(not p.sp or p.tp == 1 or (m.block_size // cp) % p.tp == 0, "parallel.tp",
          f"tp={p.tp} must divide model.block_size / parallel.cp = {m.block_size // cp} (sequence "
          f"parallelism over each rank's part)")
    _unsupported(cfg, check)
    if p.cp_attention == "ulysses":
        q_heads, kv_heads = m.n_head // p.tp, (getattr(m, "n_kv_head", 0) or m.n_head) // p.tp
        check(q_heads % cp == 0 and kv_heads % cp == 0, "parallel.cp_attention",
              f"'ulysses' needs cp={cp} to divide the query heads ({q_heads}) and key/value heads "
              f"({kv_heads}) per tp rank: use 'ring' or another parallel.cp")


def _unsupported(cfg: Config, check: Check) -> None:
    """What cp > 1 does not do yet: each a key and the way out."""
    p, cp = cfg.parallel, cfg.parallel.cp
    check(cfg.sync.mode == "sync" and cfg.sync.replica_nodes == 0, "parallel.cp",
          f"cp={cp} with sync.mode = {cfg.sync.mode!r} / sync.replica_nodes = {cfg.sync.replica_nodes}: "
          f"context parallelism needs sync.mode = 'sync' without replica_nodes (or parallel.cp = 1)")
    check(cfg.model.dropout == 0, "model.dropout",
          f"{cfg.model.dropout} with parallel.cp={cp}: the context-parallel attention has no dropout; "
          f"set model.dropout = 0 or parallel.cp = 1")
    check(not cfg.train.compile, "train.compile",
          f"not supported with parallel.cp={cp} yet (the ring's exchanges are not traced); set "
          f"train.compile = false")
    check(getattr(cfg.model, "moe_aux_loss_coef", 0.0) == 0, "model.moe_aux_loss_coef",
          f"{getattr(cfg.model, 'moe_aux_loss_coef', 0.0)} with parallel.cp={cp}: the load-balancing "
          f"loss would see only each rank's part of a sequence; set it to 0 (or "
          f"model.moe_bias_update_rate for aux-loss-free balancing) or parallel.cp = 1")
