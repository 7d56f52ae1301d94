"""Where a launch starts: the newest peer snapshot if it is newer than the newest PFS checkpoint,
else the newest checkpoint that loads (older ones are tried when it does not), else step 0.

Owns the choice between those and what is said about it: a snapshot not used is named in one
warning, with what the run does instead. It must never let a run train from step 0 on a model a
failed load wrote into (DCP reads in place): that is refused in one line. The checks a checkpoint
passes before it is loaded are config_rules' and the sampler's; the loading is the manager's.
"""
from __future__ import annotations

from pathlib import Path

from hpctrain import logs
from hpctrain.config_rules import check_resume_batch, check_same_model
from hpctrain.data.sampler import check_same_dataset, saved_sampler_state
from hpctrain.errors import CheckpointError, NoIntactCheckpoint
from hpctrain.train.bad_steps import check_resumed_weights


def resume_newest(trainer) -> None:
    """Collective: the trainer's state from the newest usable snapshot or checkpoint, or none."""
    snapshot, rejected = trainer.snapshots.resume(lambda: newest_pfs_step(trainer))
    written = None
    if snapshot is not None:
        step = int(snapshot.name.split("_")[-1])
        try:
            return resume_from(trainer, snapshot, f"the peer snapshot of step {step} (no PFS read)")
        except CheckpointError as e:
            rejected, written = str(e), (snapshot if e.state_written else None)
    if rejected and trainer.ctx.is_main:
        logs.warning(f"warning: peer snapshot in {trainer.snapshots.path} not used: {rejected}")
    if trainer.ckpt.resume_newest(lambda path: resume_from(trainer, path)) is None:
        start_afresh(trainer.ctx, rejected, written)


def start_afresh(ctx, rejected: str | None, written: Path | None) -> None:
    """No checkpoint loaded: step 0 on the weights this job initialized, said where a snapshot
    was not used; refused where a failed load already wrote into them."""
    if written is not None:
        raise CheckpointError(
            f"{written}: its load failed after writing into this job's model and there is no PFS "
            f"checkpoint to fall back on; not training from step 0 on a partly loaded model: "
            f"remove the peer snapshot folders ({written.parent}) and rerun to start afresh")
    if rejected and ctx.is_main:
        logs.warning("warning: no PFS checkpoint to fall back on: training starts from step 0 "
                     "with freshly initialized weights")


def newest_pfs_step(trainer) -> int:
    """Collective: the step of the newest intact PFS checkpoint (-1: none)."""
    try:
        path = trainer.ckpt.latest()
    except NoIntactCheckpoint:
        return -1
    return -1 if path is None else int(path.name.split("_")[-1])


def resume_from(trainer, path: Path, source: str | None = None) -> None:
    """Collective: checkpoint or snapshot `path` into the trainer, after the checks that refuse
    another model, global batch, dataset or sync mode."""
    saved = trainer.ckpt.read_trainer_state(path)
    check_same_model(saved["trainer"]["config"]["model"], trainer.cfg.to_dict()["model"], path)
    states = trainer.checkpoint_states(saved)  # the sync strategy refuses another mode's first
    check_resume_batch(saved_sampler_state(saved, path)["global_batch"], trainer.plan.train,
                       trainer.plan.dp_size, path)
    check_same_dataset(trainer.data.sampler, saved, trainer.cfg.data.path, path)
    trainer.sync.before_load(saved.get("sync", {}))  # DiLoCo: adopts a sync-mode checkpoint
    trainer.ckpt.load_states(path, states)
    check_resumed_weights(trainer.model, trainer.ctx.device, path)  # NaN / inf: named, before a step
    trainer.sync.after_load(trainer.step)
    if trainer.ctx.is_main:
        logs.info(f"resumed from {source or f'{path} at step {trainer.step}'}")
