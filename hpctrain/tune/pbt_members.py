"""A population's members inside one MPI job, and what passes between them.

Owns: splitting COMM_WORLD into `population` members of k consecutive ranks (member m holds world
ranks m*k .. m*k+k-1; inside it, rank r is the same position of the member's layout as rank r of
any other member), the exploit copy (every rank of a losing member receives, straight from the
rank at its position in the donor member, the tensors it holds: parameters, then each parameter's
optimizer state; plus the fp16 loss scale: MPI point-to-point, no file), and setting a member's
hyperparameters on its live trainer. It must never decide who copies whom (pbt_space.py) or write
files (pbt.py does).
"""
from __future__ import annotations

import dataclasses

import torch

from hpctrain.errors import ConfigError

TAG_TENSOR, TAG_OBJECT = 2001, 2002


def split_members(world, population: int):
    """(this rank's member index, the member's communicator, ranks per member k)."""
    size = world.Get_size()
    if population < 1 or size % population:
        raise ConfigError(f"config key 'tune.pbt.population': {population} members do not divide "
                          f"the {size} ranks of this job (mpiexec -n population*k)")
    k = size // population
    member = world.Get_rank() // k
    return member, world.Split(color=member, key=world.Get_rank()), k


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (TP/FSDP), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def member_tensors(model, optimizer) -> list[torch.Tensor]:
    """What one rank holds of its member's training state, in an order every member shares: each
    parameter (named_parameters order: tied weights once) then its optimizer state by name."""
    out = []
    for _, p in model.named_parameters():
        out.append(_local(p))
    for _, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        out.extend(_local(state[name]) for name in sorted(state) if isinstance(state[name], torch.Tensor))
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def send_state(trainer, world, dest: int) -> None:
    tensors = member_tensors(trainer.model, trainer.optimizer)
    world.send((len(tensors), trainer.engine.loss_scaling.state_dict()), dest=dest, tag=TAG_OBJECT)
    for t in tensors:
        world.Send(_as_bytes(t.cpu()).numpy(), dest=dest, tag=TAG_TENSOR)


@torch.no_grad()
def receive_state(trainer, world, source: int) -> None:
    tensors = member_tensors(trainer.model, trainer.optimizer)
    count, scaling = world.recv(source=source, tag=TAG_OBJECT)
    if count != len(tensors):
        raise RuntimeError(f"exploit: rank {source} sends {count} tensors, this rank holds "
                           f"{len(tensors)}; every member must have the same layout")
    for t in tensors:
        buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
        world.Recv(buf.numpy(), source=source, tag=TAG_TENSOR)
        t.copy_(buf.view(t.dtype).reshape(t.shape))
    trainer.engine.loss_scaling.load_state_dict(scaling)


def copy_members(trainer, world, plan: list[tuple[int, int]], member: int, k: int) -> None:
    """Every rank: carry out the exploit plan [(loser, donor)] between the same positions."""
    position = world.Get_rank() - member * k
    for loser, donor in plan:
        if member == donor:
            send_state(trainer, world, loser * k + position)
        elif member == loser:
            receive_state(trainer, world, donor * k + position)


def apply_values(trainer, values: dict) -> None:
    """Set a member's hyperparameters ({"train.lr": ...}) on its live trainer: the values the lr
    schedule and the clip read at every step (`trainer.hparams`; the config stays as given), and the
    optimizer's parameter groups."""
    t = dataclasses.replace(trainer.hparams, **{key.split(".", 1)[1]: value for key, value in values.items()})
    trainer.hparams = t
    groups = trainer.optimizer.param_groups
    groups[0]["weight_decay"] = t.weight_decay  # the matrices' group (hpctrain/model/optim.py)
    for group in groups:
        if "betas" in group:
            group["betas"] = (t.beta1, t.beta2)
