"""sync.mode = "async_diloco" in the planner: its layout rules, server and host memory, bytes per
arrival and checkpoint bytes (hpctrain/sync/async_diloco.py, inbox.py, global_model.py,
async_groups.py train it).

Owns the arithmetic of:
- layout (async_groups.py): flat, the last sync.ps_servers ranks serve (groups of tp x pp, one
  server rank per position of a replica) and replicas = (ranks - servers) / (tp x pp); with
  sync.replica_nodes = R the servers fill the last whole groups of R nodes and a replica is a
  group (DDP inside). Either way a part of the model (a (pp, tp) position: the largest stage's
  parameters) is served by S = ps_servers / (tp x pp) server ranks, each a slice n * s // S.
  The trainer's refusals (config_rules.py, async_groups.py) come back with their reasons.
- bytes per arrival of one part (what metrics.jsonl records as pushed_bytes / pulled_bytes):
  uncompressed, the replica locks the servers' slices and reads, then writes back, theta,
  momentum and accumulator: 12 B per parameter out and 12 back; a catch-up reads theta (4 B per
  parameter back, once per round in which others arrived). Compressed (inbox.py), per server
  slice: the push in plan/wire.py's format of sync.compression (codes + fp32 scales per int8 /
  int4 block) + 16 header bytes, and the pull of the global model's change in
  sync.pull_compression's format + 16; a pull is skipped when the change is the replica's own
  (outer SGD; delayed Nesterov between momentum arrivals): the figures are the upper bound.
- host memory (MPI_Win_allocate and numpy, not the GPU): a server rank holds its slice of theta,
  momentum and accumulator in fp32 (12 B each) and, compressed, one push slot and one pull slot
  per replica and its fp32 view of each replica's weights (4 B per element per replica); a
  replica's pusher rank holds its round's start point, the pseudo-gradient and the weights it gets
  back (fp32 flat copies of its part) and, with sync.error_feedback, its push residual.
- checkpoint (async_state.py): the global model (4 B), momentum and accumulator (8 B), and per
  replica its weights, start point, inner AdamW m, v (16 B) + its push residual (4 B).
It must never format output (report.py).
"""
from __future__ import annotations

from hpctrain.plan.wire import encoded_bytes, wire_layout

MODE = "async_diloco"
HEADER_BYTES = 16  # per server per push (arrival, lr_scale words) and per pull (inbox.py)
BLOCK = 256  # sync.int8_block's default: elements per fp32 scale


def positions(job) -> int:
    return job.tp * job.pp


def group_ranks(job) -> int:
    """Ranks of one replica: tp x pp (flat) or a group of sync.replica_nodes nodes."""
    return job.replica_nodes * job.gpus_per_node if job.replica_nodes else positions(job)


def replicas(job) -> int:
    return (job.world - job.ps_servers) // group_ranks(job)


def servers_per_part(job) -> int:
    """Server ranks that share one part (position) of the model: ps_servers / (tp x pp)."""
    return job.ps_servers // positions(job)


def pull_kind(job) -> str:
    return job.compression if job.pull_compression == "same" else job.pull_compression


def check(job) -> None:
    """The trainer's refusals of an async_diloco layout, each one line naming the option."""
    if job.sync_mode != MODE:
        for key, ok in (("pull_compression", job.pull_compression == "same"),
                        ("ps_servers", job.ps_servers == 1), ("error_feedback", not job.error_feedback)):
            if not ok:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(job, key)}: the planner "
                                 f"models it for --sync-mode async_diloco only; leave it at its default")
        return
    if job.dp:
        raise ValueError("--dp: 'async_diloco' counts replicas from the ranks left after "
                         "sync.ps_servers (tp x pp each, or sync.replica_nodes nodes each): leave "
                         "parallel.dp at its default")
    if job.data_parallel == "fsdp":
        raise ValueError("--data-parallel fsdp: " + (
            "FSDP inside a replica of nodes is not modelled by the planner; plan it with ddp"
            if job.replica_nodes else "'fsdp' with sync.mode = 'async_diloco' shards a replica of "
            "nodes: set sync.replica_nodes (FSDP inside each group of nodes), or use 'ddp'"))
    if job.precision == "fp16":
        raise ValueError("--precision fp16 needs loss scaling agreed by every rank each step, which "
                         "sync.mode='async_diloco' workers do not do: use fp32 or bf16 there")
    if job.pull_compression != "same" and job.compression == "none":
        raise ValueError(f"--pull-compression {job.pull_compression}: sets the format of "
                         f"async_diloco's compressed pulls: use --compression bf16 | int8 | int4")
    if job.error_feedback and job.compression not in ("int8", "int4"):
        raise ValueError(f"--error-feedback: keeps async_diloco's push quantization residuals: use "
                         f"--compression int8 | int4 (not '{job.compression}'), or leave it false")
    _check_servers(job)


def _check_servers(job) -> None:
    """async_groups.py's _server_blocks / _server_groups, in their words."""
    block, n = group_ranks(job), job.ps_servers
    if job.replica_nodes:
        blocks = job.nodes // job.replica_nodes
        if n % block or not 0 < n // block < blocks:
            raise ValueError(f"--ps-servers {n} server ranks with sync.replica_nodes: the servers "
                             f"fill whole groups of nodes ({block} ranks each) and leave at least one "
                             f"of the {blocks} groups to train; use a multiple of {block} below "
                             f"{block * blocks}")
        return
    if n < 1 or n % block:
        raise ValueError(f"--ps-servers {n} server ranks for replicas of {block} ranks "
                         f"(parallel.tp x parallel.pp): use a multiple of {block}")
    if n >= job.world:
        raise ValueError(f"--ps-servers {n} servers leave no replica among {job.world} ranks "
                         f"(run more ranks)")


def slices(job, n_part: int) -> list[int]:
    """Elements of each server's slice of a part of `n_part` parameters (global_model.py)."""
    s = servers_per_part(job)
    return [n_part * (i + 1) // s - n_part * i // s for i in range(s)]


def wire_bytes(n: int, kind: str) -> int:
    """One server slice of n elements encoded in `kind` (inbox.py _codecs)."""
    chunk, block = wire_layout(n, 1, kind, BLOCK)
    return encoded_bytes(chunk, kind, block)


def arrival_bytes(job, n_part: int) -> dict:
    """Bytes one pusher moves per arrival of its part, out and back (upper bound: every pull)."""
    if job.compression == "none":
        return {"pushed": 12 * n_part, "pulled": 12 * n_part, "catch-up pull": 4 * n_part}
    push = sum(wire_bytes(n, job.compression) + HEADER_BYTES for n in slices(job, n_part))
    pull = sum(wire_bytes(n, pull_kind(job)) + HEADER_BYTES for n in slices(job, n_part))
    return {"pushed": push, "pulled": pull, "catch-up pull": pull}


def per_step(job, n_part: int) -> tuple[int, str]:
    """(bytes per step out + back, what moves): an arrival amortized over its round."""
    a = arrival_bytes(job, n_part)
    fmt = ("fp32 theta, momentum, accumulator read and written back" if job.compression == "none"
           else f"{job.compression} push, {pull_kind(job)} pull")
    return ((a["pushed"] + a["pulled"]) // job.inner_steps,
            f"async_diloco: {a['pushed'] / 1e9:.3g} GB out + {a['pulled'] / 1e9:.3g} GB back per "
            f"arrival of {job.inner_steps} steps ({fmt}), no blocking collective")


def link(job) -> str:
    """Servers sit on the last ranks (groups of nodes): another node unless the job is one node."""
    return "inter-node" if job.replica_nodes or job.nodes > 1 else "intra-node"


def server_bytes(job, n_part: int) -> dict:
    """Host memory of the server rank with the largest slice."""
    n, r = max(slices(job, n_part)), replicas(job)
    out = {"theta, momentum, accumulator (fp32)": 12 * n}
    if job.compression != "none":
        out["push + pull slots (one each per replica)"] = r * (wire_bytes(n, job.compression)
                                                               + wire_bytes(n, pull_kind(job)))
        out["views of each replica's weights (fp32)"] = 4 * n * r
    out["total"] = sum(out.values())
    return out


def pusher_bytes(job, n_part: int) -> dict:
    """Host memory of a replica's pusher: flat fp32 copies of its part."""
    out = {"start point (fp32)": 4 * n_part,
           "pseudo-gradient + new weights (transient)": 8 * n_part}
    if job.error_feedback:
        out["push residual (fp32)"] = 4 * n_part
    out["total"] = sum(out.values())
    return out


def host_per_node(job, n_part: int) -> tuple[int, str]:
    """(the busiest node's async host bytes, where): a node of servers or of replica ranks
    (every replica rank keeps a start point and gets the new weights, the pushers also the
    residual)."""
    per = job.gpus_per_node
    server_node = min(job.ps_servers, per) * server_bytes(job, n_part)["total"]
    mine = pusher_bytes(job, n_part)
    residual = mine.get("push residual (fp32)", 0)  # the pushers' alone (DDP inside: dp rank 0)
    pushers = min(positions(job), per) if job.replica_nodes else per
    replica_node = per * (mine["total"] - residual) + pushers * residual
    if server_node >= replica_node:
        return server_node, f"{min(job.ps_servers, per)} server rank(s)"
    return replica_node, f"{per} replica ranks"


def checkpoint_bytes(job, n: int) -> int:
    return 12 * n + replicas(job) * (16 + 4 * job.error_feedback) * n


def sync_line(job) -> str:
    pulls = "" if job.compression == "none" else f", {pull_kind(job)} pulls"
    nodes = f" of {job.replica_nodes} node(s)" if job.replica_nodes else ""
    return (f" ({replicas(job)} replicas{nodes} of {group_ranks(job)} rank(s), {job.ps_servers} "
            f"server rank(s), inner_steps {job.inner_steps}, {job.compression} pushes{pulls}"
            f"{', error feedback' if job.error_feedback else ''})")
