"""What the sbatch templates ask before they start any rank: which launcher, and may this job start.

    python -m hpctrain.distributed.sbatch_helper launcher
        one line `LAUNCHER<TAB>SRUN_MPI<TAB>MPIEXEC<TAB>WHY` for `IFS=$'\t' read -r` in the templates (a path may hold spaces)
    python -m hpctrain.distributed.sbatch_helper check CONFIG.toml [--section.key=value ...]
        exit 0, or one `error: ...` line and exit 2: a bad config, or a Slurm time limit that leaves
        no time to train (hpctrain/distributed/preempt.py, `time_limit_error`)
    python -m hpctrain.distributed.sbatch_helper gone NODE [NODE ...]
        the nodes of the job that no longer run a step, one a line (see `gone_nodes`); exit 1 with
        one `error: ...` line when none answers (then nothing can be told)

Owns the launcher choice. The PyPI `mpich` wheel needs its own `mpiexec` (Hydra, which starts its
proxies through srun inside an allocation): under `srun --mpi=pmi2` Slurm 22.05's PMI server cuts
the wheel's long PMI lines and MPI_Init fails or hangs (docs/multinode.md). Any other MPI (a site
MPI, or Open MPI loaded through MPI4PY_LIBMPI) gets `srun`, with `--mpi=pmix` for Open MPI and
`--mpi=pmi2` for the rest. HPCTRAIN_LAUNCHER and HPCTRAIN_SRUN_MPI override. The library is found
without initializing MPI (mpi4py.rc.initialize = False): the batch shell is no MPI process.

Owns, too, telling which nodes are gone when a launcher ended without naming one: Hydra's
`mpiexec` ends the whole step as soon as a node's proxy dies (`control_cb ... assert (!closed)
failed`), usually before the survivors' heartbeat names the node, so train.sbatch asks the nodes:
one `srun --overlap` step of `true` per node, all at once (a live node runs it in ~0.4 s), and
beside it a TCP connection to each node's slurmd (`scontrol show node/config`). A node whose slurmd
is gone refuses that connection at once, or never answers it (CONNECT_TIMEOUT_S), where srun itself
would retry for MessageTimeout; its step fails or never ends (the deadline). A rank's own error
leaves every node answering: no relaunch.

Checking once in the batch shell prints a config error once, before any launcher can kill rank 0
on another rank's exit (`srun --kill-on-bad-exit`) and lose its line. It must never import torch.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WHEELS = ("mpich",)  # PyPI MPI wheels whose own mpiexec must start the ranks


def loaded_libmpi() -> tuple[str, str]:
    """(path of the libmpi mpi4py loads, its vendor) without MPI_Init; ("", "") when unknown."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]
    with open("/proc/self/maps") as maps:
        # the path is the 6th field and may hold spaces (a checkout in "My Projects/")
        paths = [line.rstrip("\n").split(None, 5)[5] for line in maps
                 if "/libmpi" in line and len(line.split(None, 5)) == 6]
    return (paths[0] if paths else ""), vendor


def wheel_mpiexec(libmpi: str) -> tuple[str, str] | None:
    """(wheel name, its mpiexec) when `libmpi` is a file of an installed PyPI MPI wheel."""
    from importlib import metadata

    if not libmpi:
        return None
    real = Path(libmpi).resolve()
    for name in WHEELS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        files = [Path(dist.locate_file(f)).resolve() for f in dist.files or ()]
        if real in files:
            mpiexec = next((str(f) for f in files if f.name == "mpiexec"), "mpiexec")
            return name, mpiexec
    return None


def choose_launcher(env: dict | None = None) -> tuple[str, str, str, str]:
    """(launcher, srun --mpi plugin, mpiexec to run, why) for the MPI that mpi4py loads."""
    env = os.environ if env is None else env
    try:
        libmpi, vendor = loaded_libmpi()
    except Exception as e:  # noqa: BLE001 - no mpi4py, a broken MPI: the ranks will say it
        libmpi, vendor, failure = "", "", f"cannot tell which MPI mpi4py loads ({e})"
    else:
        failure = ""
    srun_mpi = env.get("HPCTRAIN_SRUN_MPI") or ("pmix" if vendor == "Open MPI" else "pmi2")
    wheel = wheel_mpiexec(libmpi)
    mpiexec = wheel[1] if wheel else (shutil.which("mpiexec", path=env.get("PATH")) or "mpiexec")
    given = env.get("HPCTRAIN_LAUNCHER")
    if given:
        return given, srun_mpi, mpiexec, f"HPCTRAIN_LAUNCHER={given}"
    if wheel:
        return ("mpiexec", srun_mpi, mpiexec,
                f"mpi4py loads the PyPI {wheel[0]} wheel ({libmpi}): its own mpiexec (Slurm's "
                f"pmi2 cuts the wheel's long PMI lines); HPCTRAIN_LAUNCHER=srun overrides")
    why = failure or f"mpi4py loads {vendor or 'an MPI'} from {libmpi or '?'} (not a PyPI wheel)"
    return "srun", srun_mpi, mpiexec, f"{why}: srun --mpi={srun_mpi}; HPCTRAIN_LAUNCHER=mpiexec overrides"


def check(argv: list[str]) -> int:
    """Load the config as `train` would and refuse a time limit that leaves no time to train."""
    from hpctrain import config, logs
    from hpctrain.distributed import preempt, slurm
    from hpctrain.errors import UserError

    if not argv:
        print("error: usage: sbatch_helper check CONFIG.toml [--section.key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = config.load(argv[0], argv[1:])
        job = slurm.SlurmJob.from_env()
        margin = cfg.slurm.time_margin_s
        limit = slurm.time_limit_seconds(job) if job is not None and margin > 0 else None
        err = preempt.time_limit_error(job, limit, margin, cfg.run.dir)
        if err:
            raise UserError(err)
    except UserError as e:
        logs.error(f"error: {e}")
        return 2
    return 0


PROBE_TIMEOUT_S = 10.0  # HPCTRAIN_PROBE_TIMEOUT_S: a node that runs no step within it is gone
CONNECT_TIMEOUT_S = 3.0  # a node whose slurmd takes no TCP connection within it is gone


def probe_command(node: str) -> list[str]:
    """One task of `true` on `node`, as a step of this job beside any other (--overlap: a dead
    step may still hold the node's CPUs)."""
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", f"--nodelist={node}",
            "--time=1", "--quiet", "true"]


def slurmd_addresses(nodes: list[str]) -> dict[str, tuple[str, int]]:
    """{node: (NodeAddr, slurmd port)} from scontrol; {} when scontrol cannot tell."""
    def scontrol(*args: str) -> str:
        try:
            return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    port = next((int(line.split("=")[1]) for line in scontrol("show", "config").splitlines()
                 if line.replace(" ", "").startswith("SlurmdPort=")), 6818)
    out = {}
    for line in scontrol("show", "node", "-o", ",".join(nodes)).splitlines():
        fields = dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)
        if fields.get("NodeName") in nodes and fields.get("NodeAddr"):
            out[fields["NodeName"]] = (fields["NodeAddr"], int(fields.get("Port") or port))
    return out


def refuses_connections(address: tuple[str, int], timeout_s: float) -> str:
    """Why `address` (a slurmd) takes no TCP connection ('' when it takes one): a node whose
    slurmd is gone refuses at once (or never answers), where srun would retry for MessageTimeout."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as e:
        return f"its slurmd at {address[0]}:{address[1]} takes no connection: {e.strerror or e}"
    return ""


def gone_nodes(nodes: list[str], timeout_s: float) -> dict[str, str]:
    """{node: why} for the nodes whose probe step failed or did not end within `timeout_s`, or
    whose slurmd refused a TCP connection before its probe step ended."""
    probes = {n: subprocess.Popen(probe_command(n), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
              for n in nodes}
    with ThreadPoolExecutor(len(nodes)) as pool:
        refused = {node: pool.submit(refuses_connections, address, CONNECT_TIMEOUT_S)
                   for node, address in slurmd_addresses(nodes).items()}
        deadline, gone, alive = time.monotonic() + timeout_s, {}, set()
        while len(gone) + len(alive) < len(nodes) and time.monotonic() < deadline:
            for node, probe in probes.items():
                if node in gone or node in alive:
                    continue
                if probe.poll() is not None:
                    err = probe.communicate()[1].strip().splitlines() or ["no message"]
                    (alive.add(node) if probe.returncode == 0 else
                     gone.__setitem__(node, f"srun exit {probe.returncode}: {err[-1]}"))
                elif node in refused and refused[node].done() and refused[node].result():
                    gone[node] = refused[node].result()
            time.sleep(0.05)
    for node, probe in probes.items():
        if probe.poll() is None:
            os.killpg(probe.pid, 9)
            probe.communicate()
            if node not in gone:
                gone[node] = f"no step ran on it within {timeout_s:g} s"
    return gone


def gone(nodes: list[str]) -> int:
    """Print the gone nodes, one a line; why on stderr (one line each); exit 1 when none answered.
    `--others` first: the nodes besides those a verdict named (its lines say so)."""
    others = nodes[:1] == ["--others"]
    nodes = nodes[1:] if others else nodes
    if not nodes:
        print("error: usage: sbatch_helper gone [--others] NODE [NODE ...]", file=sys.stderr)
        return 2
    timeout_s = float(os.environ.get("HPCTRAIN_PROBE_TIMEOUT_S") or PROBE_TIMEOUT_S)
    if shutil.which("srun") is None:
        print(f"error: no srun on PATH: cannot probe {','.join(nodes)} to tell which node is gone",
              file=sys.stderr)
        return 1
    t0 = time.monotonic()
    found = gone_nodes(nodes, timeout_s)
    took = time.monotonic() - t0
    if len(found) == len(nodes):
        print(f"error: none of {','.join(nodes)} answered a probe step ({nodes[0]}: "
              f"{found[nodes[0]]}): cannot tell which node is gone; check `scontrol show job "
              f"$SLURM_JOB_ID` and `sinfo`", file=sys.stderr)
        return 1
    if not found and others:
        print(f"[train.sbatch] the {len(nodes)} other node(s) answered ({len(nodes)} probed in {took:.1f} s)",
              file=sys.stderr)
    elif not found:
        print(f"[train.sbatch] every node answered ({len(nodes)} probed in {took:.1f} s): no node is "
              f"lost, no relaunch", file=sys.stderr)
    for node, why in found.items():
        print(f"[train.sbatch] node {node} gone ({why}; {len(nodes)} node(s) probed in {took:.1f} s)",
              file=sys.stderr)
        print(node)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launcher"]:
        print("\t".join(choose_launcher()), flush=True)  # tabs: a path may hold spaces
        return 0
    if argv[:1] == ["check"]:
        return check(argv[1:])
    if argv[:1] == ["gone"]:
        return gone(argv[1:])
    print("usage: python -m hpctrain.distributed.sbatch_helper launcher | check CONFIG.toml "
          "[--section.key=value ...] | gone [--others] NODE [NODE ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
