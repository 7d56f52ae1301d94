"""The run plan: what the config leaves open, resolved ONCE, frozen, from (config, ranks, mesh).

The user's `Config` is never written after parsing (config.toml is exactly it). What depends on the
job is computed here and read from here by everything downstream:

    world_size, dp_size, position   where this rank reads in the data order (the mesh's dp
                                    coordinate, a ps worker's index, an async replica's 0 of 1)
    train                           the train section with train.grad_accum resolved (from
                                    train.global_batch and dp: elastic restarts) and train.precision
                                    resolved ("auto" -> bf16 or fp32, measured job-wide)
    precision_given, tf32           what the user wrote, and whether TF32 matmuls are on
    end_step                        train.stop_at_step or train.steps
    faults                          the test-only step faults (hpctrain/step_faults.py; off unless
                                    HPCTRAIN_TEST_FAULTS is set)

Owns that resolution. It must never build the model, the data or the strategy (the loop does) nor
write the config.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hpctrain.config import Config
from hpctrain.config_rules import resolve_grad_accum
from hpctrain.config_schema import TrainConfig
from hpctrain.distributed import DistContext
from hpctrain.distributed.mesh import Mesh
from hpctrain.step_faults import StepFaults, step_faults
from hpctrain.sync import modes
from hpctrain.train.precision import apply_deterministic, apply_tf32, resolve_precision


@dataclasses.dataclass(frozen=True)
class RunPlan:
    world_size: int
    dp_size: int
    position: Any                  # dp_rank / dp_size of this rank in the data order
    train: TrainConfig             # the user's train section, grad_accum and precision resolved
    precision_given: str           # train.precision as written ("auto" stays "auto")
    tf32: bool
    faults: StepFaults

    @property
    def grad_accum(self) -> int:
        return self.train.grad_accum

    @property
    def precision(self) -> str:
        return self.train.precision

    @property
    def end_step(self) -> int:
        """The step this launch trains up to: train.stop_at_step, else train.steps."""
        return self.train.stop_at_step or self.train.steps

    def resolved_config(self, cfg: Config, train: TrainConfig | None = None) -> Config:
        """A copy of `cfg` with the resolved train section (or `train`: PBT's member values) -- what
        a checkpoint's "trainer" entry records as its config. `cfg` itself is left as given."""
        return dataclasses.replace(cfg, train=train or self.train)


def resolve(cfg: Config, ctx: DistContext, mesh: Mesh) -> RunPlan:
    """The run plan of this job. Collective where train.precision is "auto" (every rank measures
    and agrees) and where the mode counts its workers (async_diloco); sets torch's TF32 matmul
    mode for this rank's device (before the MFU peak reads it: tf32's datasheet row), and on CUDA
    its deterministic algorithms where parallel.deterministic_experts is on."""
    t = cfg.train
    position = modes.data_position(cfg, ctx, mesh)
    grad_accum = resolve_grad_accum(t, position.dp_size)
    precision = resolve_precision(t.precision, ctx.device, t.micro_batch_size * cfg.model.block_size,
                                  cfg.model.n_embd)
    tf32 = apply_tf32(ctx.device, t.tf32)
    apply_deterministic(ctx.device, cfg.parallel.deterministic_experts)  # CUDA only
    return RunPlan(world_size=ctx.world_size, dp_size=position.dp_size, position=position,
                   train=dataclasses.replace(t, grad_accum=grad_accum, precision=precision),
                   precision_given=t.precision, tf32=tf32, faults=step_faults())
