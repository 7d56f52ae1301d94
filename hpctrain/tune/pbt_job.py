"""`python -m hpctrain tune pbt`'s job on every rank: split the ranks into members (pbt_members.py),
start each member's process group, one heartbeat over COMM_WORLD, run the population (pbt_loop.py)
and requeue when asked.

Owns: the job's start and end. It must never train itself (pbt_loop.PopulationRun does) or hold the
population's state (pbt.py).
"""
from __future__ import annotations

from pathlib import Path

from hpctrain import logs
from hpctrain.tune import pbt_members
from hpctrain.tune.pbt import load, member_config


def pbt(config_path: str, overrides: list[str]) -> int:
    """Every rank of the job: split into members, train them as a population, exit status."""
    cfg, tune, pbt_cfg = load(config_path, overrides)
    from mpi4py import MPI

    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.distributed.preempt import install_signal_handlers, requeue_if_requested
    from hpctrain.distributed.watchdog import watch_peers
    from hpctrain.distributed import run_lock
    from hpctrain.tune.pbt_loop import PopulationRun

    install_signal_handlers(cfg.slurm.signals)
    world = MPI.COMM_WORLD
    member, member_comm, k = pbt_members.split_members(world, pbt_cfg.population)
    mcfg = member_config(cfg, member)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, comm=member_comm,
                           cpu_collectives=cfg.parallel.offload == "all")
    if world.Get_rank() == 0:
        logs.info(f"[pbt] {pbt_cfg.population} members of {k} rank(s) in {cfg.run.dir}; every "
                  f"{pbt_cfg.ready} steps the worst {pbt_cfg.n_exchanged()} copy one of the best "
                  f"{pbt_cfg.n_exchanged()}")
    # one heartbeat over COMM_WORLD (the stop vote and the rounds' allgather span the members)
    watched = world_watch(world, cfg.dist.heartbeat_timeout_s)
    # forensics (stacks, last collective) of a verdict or stall go to the population's run dir
    with watch_peers(watched, cfg.dist.heartbeat_timeout_s, cfg.run.dir, cfg.dist.stall_timeout_s), \
            run_lock.hold(mcfg.run.dir, ctx, job=world):  # taken-over locks: one line per job
        run = PopulationRun(mcfg, ctx, tune, pbt_cfg, world, member, k, Path(cfg.run.dir))
        status = run.fit()
    world.Barrier()  # every rank's watcher has stopped before world rank 0 ends their store
    watched.server = None
    teardown()
    requeue_if_requested(world)
    return status


def world_watch(world, timeout_s: float):
    """What watch_peers needs to watch every rank of the job, not only this member's: world ranks
    and hosts, and a heartbeat store of its own on world rank 0 (`server`: kept alive by the
    caller until every rank's watcher has stopped)."""
    import datetime
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpctrain.distributed.bootstrap import _rendezvous

    rank, hosts = world.Get_rank(), world.allgather(socket.gethostname())
    addr, _ = _rendezvous(world, rank, hosts)  # reachable from every node, like the members' own
    server = None
    if rank == 0 and timeout_s > 0 and world.Get_size() > 1:
        server = dist.TCPStore(addr, 0, world.Get_size(), is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    port = world.bcast(server.port if server is not None else 0, root=0)
    world.Barrier()  # the port has reached every rank before rank 0 goes on (init_distributed)
    return SimpleNamespace(rank=rank, world_size=world.Get_size(), comm=world, master_addr=addr,
                           master_port=port, hosts=tuple(hosts), server=server)
