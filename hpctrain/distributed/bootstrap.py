"""Launch: from an MPI world (mpiexec, srun, or a plain singleton) to torch.distributed.

Owns: discovering rank / world size / node-local rank from mpi4py, choosing the backend (NCCL when
CUDA is present, Gloo otherwise) and the device, agreeing on a rendezvous address, thread counts,
collective timeouts, and teardown. This is the only module that knows about MPI launch details and
environment overrides (Slurm specifics live in slurm.py: a `srun` without an MPI plugin, which
would start N one-rank worlds, is refused there). It must never import model, data or checkpoint code.

Environment overrides (they win over discovery):
  MASTER_ADDR / MASTER_PORT   rendezvous address and port of rank 0's TCP store
  HPCTRAIN_IFACE              network interface whose IPv4 address rank 0 advertises (e.g. ib0);
                              without it, a job spanning nodes uses the interface whose subnet
                              reaches every node (never loopback: netif.py), and Gloo binds there
                              too (GLOO_SOCKET_IFNAME unless set); NCCL only when HPCTRAIN_IFACE
                              names it (NCCL_SOCKET_IFNAME unless set), else NCCL chooses
  MPIR_CVAR_ENABLE_GPU / OMPI_MCA_opal_cuda_support   default 0: hpctrain gives MPI host memory
                              only, so a CUDA-aware MPI opens no CUDA context at MPI_Init (which
                              runs before the rank's GPU is chosen: it would land on GPU 0)
  HPCTRAIN_RANKS_PER_NODE     split one machine's ranks into "nodes" of this many ranks (tests);
                              threads per rank still count every rank on the machine
  HPCTRAIN_THREADS            intra-op threads per rank (else the machine's cores / the job's ranks
                              that really share it: MPI's shared-memory split of COMM_WORLD)
  TORCH_CPP_LOG_LEVEL         set: torch's C++ warnings are shown as the user asked, also while the
                              store connects (unset, they are hidden there: _quiet_c10d_warnings)
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain import logs
from hpctrain.distributed import netif, slurm
from hpctrain.errors import ConfigError

RENDEZVOUS_PROBE_S = 15.0  # a rank that cannot reach rank 0's store says so after this long
_timeout = datetime.timedelta(seconds=300.0)  # dist.timeout_s, set by init_distributed


def new_group(ranks=None, **kwargs) -> dist.ProcessGroup:
    """dist.new_group with dist.timeout_s (torch's own default is 10 min for NCCL, 30 for Gloo,
    whatever the world group has). Collective: every rank calls it for every group."""
    kwargs.setdefault("timeout", _timeout)
    return dist.new_group(ranks, **kwargs)


def apply_timeout(group: dist.ProcessGroup) -> None:
    """Give a group torch made (a DeviceMesh axis) dist.timeout_s."""
    dist.distributed_c10d._set_pg_timeout(_timeout, group)


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout a group's backend applies (its device's backend: NCCL on GPUs, else Gloo)."""
    device = torch.device("cuda") if torch.device("cuda") in group._device_types else torch.device("cpu")
    return group._get_backend(device).options._timeout


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job. One instance per process, made by `init_distributed`."""

    rank: int
    world_size: int
    local_rank: int      # rank inside this node
    local_size: int      # ranks on this node
    node_rank: int       # index of this node (0..n_nodes-1, ordered by lowest global rank)
    n_nodes: int
    backend: str         # "nccl" | "gloo"
    device: torch.device
    threads: int
    master_addr: str
    master_port: int
    comm: object         # mpi4py MPI.Comm (COMM_WORLD)
    node_comm: object    # mpi4py communicator of this node's ranks
    iface: str | None = None   # interface Gloo/NCCL use (None: their default, one-host jobs)
    hosts: tuple = ()          # host name of every rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


MPI_HOST_MEMORY_ONLY = {"MPIR_CVAR_ENABLE_GPU": "0", "OMPI_MCA_opal_cuda_support": "0"}


def _mpi():
    for key, value in MPI_HOST_MEMORY_ONLY.items():  # before MPI_Init (module docstring)
        os.environ.setdefault(key, value)
    from mpi4py import MPI  # imported lazily: MPI_Init happens here

    return MPI


def mpi_library() -> str:
    """Which MPI this process runs on, in a few words ("MPICH 5.0.2", "Open MPI v5.0.11"): the
    first thing to check when a cluster's mpi4py was built against another MPI than `srun` expects."""
    text = _mpi().Get_library_version().replace("\0", "").strip()
    first = text.splitlines()[0] if text else "unknown MPI"
    if first.startswith("MPICH Version:"):
        return "MPICH " + first.split(":", 1)[1].strip()
    return first.split(",")[0].strip()


def _node_comm(MPI, comm, pretend: bool = True):
    """Ranks sharing a node, from MPI shared-memory split (or, with `pretend`, the forced split of
    HPCTRAIN_RANKS_PER_NODE for tests).

    Some MPI + PMI pairs hand MPI no locality at all: Open MPI 5 under a Slurm whose pmix plugin
    does not pass it (our test cluster) puts every rank alone in its "node", so every rank would
    think it leads a node (node cache, threads per rank). That pattern (all splits of size 1 while
    host names repeat) is detected, and ranks are grouped by host name instead, with a warning."""
    forced = os.environ.get("HPCTRAIN_RANKS_PER_NODE") if pretend else None
    rank = comm.Get_rank()
    if forced:
        per_node = int(forced)
        if per_node < 1:
            raise ValueError(f"HPCTRAIN_RANKS_PER_NODE={forced}: must be >= 1")
        return comm.Split(color=rank // per_node, key=rank)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    hosts = comm.allgather(socket.gethostname())
    if comm.Get_size() == 1 or comm.allreduce(shared.Get_size(), op=MPI.MAX) > 1 \
            or len(set(hosts)) == len(hosts):
        return shared
    shared.Free()
    if rank == 0:
        logs.warning(f"warning: {mpi_library()} reports no shared-memory locality (each of "
                     f"{len(hosts)} ranks alone, on {len(set(hosts))} host name(s)); grouping "
                     f"node-local ranks by host name")
    return comm.Split(color=sorted(set(hosts)).index(hosts[rank]), key=rank)


def _node_index(MPI, comm, node_comm) -> tuple[int, int]:
    is_leader = node_comm.Get_rank() == 0
    leaders = comm.Split(color=0 if is_leader else MPI.UNDEFINED, key=comm.Get_rank())
    node_rank = leaders.Get_rank() if is_leader else -1
    if is_leader:
        leaders.Free()
    node_rank = node_comm.bcast(node_rank, root=0)
    n_nodes = comm.allreduce(1 if is_leader else 0, op=MPI.SUM)
    return node_rank, n_nodes


def _resolve_own_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _rendezvous(comm, rank: int, hosts: list[str]) -> tuple[str, str | None]:
    """(address rank 0 advertises, this rank's interface for Gloo/NCCL or None).

    One host: its resolved name (loopback is fine). Several: never a loopback address; rank 0
    takes the interface whose subnet reaches every other node (see netif.py)."""
    spans_hosts = len(set(hosts)) > 1
    if os.environ.get("MASTER_ADDR"):
        addr = os.environ["MASTER_ADDR"]
    elif os.environ.get("HPCTRAIN_IFACE"):
        addr = comm.bcast(netif.iface_address(os.environ["HPCTRAIN_IFACE"]) if rank == 0 else None, root=0)
    elif not spans_hosts:
        addr = comm.bcast(_resolve_own_host() if rank == 0 else None, root=0)
    else:
        mine = comm.allgather(netif.interfaces())
        choice = None
        if rank == 0:
            nodes = {}
            for host, ifaces in zip(hosts, mine):
                nodes.setdefault(host, ifaces)
            choice = netif.choose_rendezvous(nodes, hosts[0], _resolve_own_host()).address
        addr = comm.bcast(choice, root=0)
    if spans_hosts and netif.is_loopback(addr):
        raise netif.RendezvousError(f"rendezvous address {addr} is a loopback address but the job "
                                    f"spans {len(set(hosts))} nodes; {netif.FIX}")
    if os.environ.get("HPCTRAIN_IFACE"):
        return addr, os.environ["HPCTRAIN_IFACE"]
    local = netif.local_interface_for(addr, netif.interfaces()) if spans_hosts else None
    return addr, local.name if local else None


def _use_interface(iface: str | None, asked: bool) -> None:
    """Gloo binds to the rendezvous network unless the user chose its interface. NCCL only where
    the user asked for the interface (`asked`: HPCTRAIN_IFACE) and did not set NCCL_SOCKET_IFNAME:
    the network that reaches rank 0's store can be a management network, and NCCL's own choice
    (InfiniBand / its fastest interface) is the better default for the gradients."""
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        if asked:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)


def _ranks_on_machine(MPI, job_node_comm) -> int:
    """Collective over COMM_WORLD: how many of the job's ranks really share this machine's cores
    (`job_node_comm`: this node's ranks of the whole job, unless HPCTRAIN_RANKS_PER_NODE split the
    machine into pretend nodes: each rank then got every core's threads, 722 vs 46k tok/s at 1)."""
    if not os.environ.get("HPCTRAIN_RANKS_PER_NODE"):
        return job_node_comm.Get_size()
    machine = _node_comm(MPI, MPI.COMM_WORLD, pretend=False)
    size = machine.Get_size()
    machine.Free()
    return size


def _threads_per_rank(local_size: int) -> int:
    """Intra-op threads: explicit override, Slurm's CPUs per task, or this node's cores / local ranks.

    Torch drops to 1 thread under mpiexec (MKL/OpenMP read the local rank count), so we always set it.
    """
    if os.environ.get("HPCTRAIN_THREADS"):
        return max(1, int(os.environ["HPCTRAIN_THREADS"]))
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    affinity = len(os.sched_getaffinity(0))
    cores = os.cpu_count() or 1
    if affinity < cores:  # the launcher bound us to a core set: use exactly that
        return max(1, affinity)
    return max(1, cores // max(1, local_size))


def _c10_log_level():
    """torch's C++ log threshold (c10's FLAGS_caffe2_log_level: 0 info, 1 warning, 2 error) as a
    ctypes int, or None where this build does not export it."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _quiet_c10d_warnings():
    """Hide torch's C++ warnings (errors still show) while the TCP store connects and the
    process group forms. A store client names its peer by reverse DNS (getnameinfo) only for its
    log; where that lookup cannot be answered (no DNS server reachable: err=-3, EAI_AGAIN) c10d
    prints `[c10d] The hostname of the client socket cannot be retrieved. err=-3` on every rank
    that connects, and goes on with the numeric address. A TORCH_CPP_LOG_LEVEL the user set wins."""
    level = None if os.environ.get("TORCH_CPP_LOG_LEVEL") else _c10_log_level()
    if level is None:
        yield
        return
    before = level.value
    level.value = max(before, 2)
    try:
        yield
    finally:
        level.value = before


def choose_backend(requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    if requested not in ("nccl", "gloo"):
        raise ValueError(f"dist.backend={requested!r}: expected auto, nccl or gloo")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("dist.backend='nccl' but CUDA is not available on this node")
    return requested


def cuda_device_index(node_rank: int, node_size: int, visible: int) -> int:
    """The GPU of the `node_rank`-th of `node_size` ranks on a node that sees `visible` GPUs:
    its own index where each rank has one, 0 where the launcher gave each task its own single GPU
    (Slurm's --gpus-per-task=1, which we advise against: docs/gpu.md; CUDA_VISIBLE_DEVICES then
    differs per task, and `gpus_shared` checks that)."""
    if visible < 1:
        raise ConfigError("dist.backend = 'nccl' but no GPU is visible to this rank "
                          "(CUDA_VISIBLE_DEVICES empty?)")
    return node_rank if node_size <= visible else node_rank % visible


def gpus_shared(gpu_ids: list[str]) -> dict[str, list[int]]:
    """{GPU id: the node ranks on it} for every GPU that more than one rank of a node would use."""
    users: dict[str, list[int]] = {}
    for node_rank, gpu in enumerate(gpu_ids):
        users.setdefault(gpu, []).append(node_rank)
    return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}


def _pick_gpu(job_node_comm) -> torch.device:
    """Collective over the node's ranks of the WHOLE job (PBT members included, which share the
    node's GPUs): one distinct GPU per rank, or a ConfigError naming the host and the ranks."""
    index = cuda_device_index(job_node_comm.Get_rank(), job_node_comm.Get_size(),
                              torch.cuda.device_count())
    props = torch.cuda.get_device_properties(index)
    mine = str(getattr(props, "uuid", None) or f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{index}")
    shared = gpus_shared(job_node_comm.allgather(mine))
    if shared:
        gpu, ranks = next(iter(shared.items()))
        raise ConfigError(f"{socket.gethostname()}: {job_node_comm.Get_size()} ranks but "
                          f"{torch.cuda.device_count()} GPU(s) visible: node ranks {ranks} would share "
                          f"GPU {gpu} (NCCL: 'Duplicate GPU detected'); launch one task per GPU "
                          f"(--ntasks-per-node=<GPUs> --gpus-per-node=<GPUs>)")
    return torch.device("cuda", index)


def share_node_cores(comm) -> int:
    """For a command that runs on MPI ranks without a process group (`hpctrain eval`): this rank's
    intra-op threads set as init_distributed sets them (its node's cores over the node's ranks).
    Collective over COMM_WORLD; returns the rank's index on its node (its GPU, where there are)."""
    MPI = _mpi()
    node_comm = _node_comm(MPI, comm)
    torch.set_num_threads(_threads_per_rank(_ranks_on_machine(MPI, node_comm)))
    return node_comm.Get_rank()


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, comm=None,
                     cpu_collectives: bool = False) -> DistContext:
    """Bootstrap torch.distributed from MPI. Collective calls time out after `timeout_s` seconds.

    `comm`: the ranks of this job (default COMM_WORLD); population-based training gives each
    member its sub-communicator, so that the member's ranks are a world of their own (their own
    TCP store on a port of the OS's choosing, their own default process group). `cpu_collectives`:
    under NCCL, Gloo too for host tensors (parallel.offload = "all", as torchtitan's CPU offload)."""
    MPI = _mpi()
    slurm.check_launch(MPI.COMM_WORLD.Get_size())  # `srun` without --mpi=pmi2/pmix: N singletons, refuse
    whole_job = comm is None
    comm = MPI.COMM_WORLD if whole_job else comm
    rank, world = comm.Get_rank(), comm.Get_size()
    # who logs what from here on (hpctrain/logs.py), by the launcher's rank (a PBT member's too)
    logs.setup(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    node_comm = _node_comm(MPI, comm)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    node_rank, n_nodes = _node_index(MPI, comm, node_comm)

    # PBT: the member's ranks are not all of the node's; GPUs are counted over the whole job
    job_node_comm = node_comm if whole_job else _node_comm(MPI, MPI.COMM_WORLD)
    backend = choose_backend(backend)
    if backend == "nccl":
        device = _pick_gpu(job_node_comm)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    threads = _threads_per_rank(_ranks_on_machine(MPI, job_node_comm))
    torch.set_num_threads(threads)

    global _timeout
    timeout = _timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0 owns the TCP store; port 0 lets the OS pick a free port (no race), then it is broadcast.
    hosts = comm.allgather(socket.gethostname())
    addr, iface = _rendezvous(comm, rank, hosts)
    _use_interface(iface, asked=bool(os.environ.get("HPCTRAIN_IFACE")))
    port = int(os.environ.get("MASTER_PORT", "0")) if whole_job else 0  # members: one store each
    store = None
    if rank == 0:  # its own client connects to addr too
        with _quiet_c10d_warnings():
            store = dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        port = store.port
    port = comm.bcast(port, root=0)
    # Rank 0 makes no MPI call until the process group is up: with transports that progress only
    # inside MPI calls (MPICH over libfabric tcp across nodes), the other ranks would never receive
    # the port. The barrier completes the broadcast everywhere first.
    comm.Barrier()
    if rank != 0:
        netif.probe(addr, port, RENDEZVOUS_PROBE_S, f"rank {rank} on {hosts[rank]}")
    with _quiet_c10d_warnings():
        if rank != 0:
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        dist.init_process_group("cuda:nccl,cpu:gloo" if backend == "nccl" and cpu_collectives else backend,
                                store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, local_size=local_size,
                       node_rank=node_rank, n_nodes=n_nodes, backend=backend, device=device,
                       threads=threads, master_addr=addr, master_port=port, comm=comm,
                       node_comm=node_comm, iface=os.environ.get("GLOO_SOCKET_IFNAME", iface),
                       hosts=tuple(hosts))


def teardown() -> None:
    """Barrier, destroy the process group, collect garbage (Open MPI crashes at exit otherwise)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    gc.collect()
