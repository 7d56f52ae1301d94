"""sync.mode = "async_diloco": asynchronous Local-SGD. Each replica takes its local steps, pushes
its pseudo-gradient to the global model as soon as its round ends, gets the updated model back and
goes on; no replica ever waits for another between checkpoints.

A replica's step: claim the next global batch index from the shared counter (each batch goes to
exactly one replica, so every sample is trained once per epoch across replicas however uneven
their speeds; a fast replica simply claims more) -> train it with the inner optimizer -> after
`steps_this_round` steps: g = start - local, arrive(g) applies the outer update under the servers'
locks (hpctrain/sync/outer.py: sgd | nesterov | delayed_nesterov) and returns the new global model,
which becomes the replica's weights and start point. With sync.catch_up (the default) a replica
that sees, when it claims a batch, that others arrived since it last read the global model adds
their updates to its weights then and there (its pseudo-gradient stays its own work), instead of
training the rest of its round without them. Staleness of an arrival = arrivals by others not
yet in the weights it trained on last; caught_up = those it added during the round. With sync.local_steps = "dynamic" each replica
publishes its mean step time at every arrival and sets its next round's steps from the fastest
replica's (outer.dynamic_local_steps), so rounds take about the same wall time.

The step counter is global: a replica that trained batch k is at step k + 1 (the learning rate
follows global progress); checkpoints come at the regular steps, when the claim counter reaches
them: every replica finishes the batches it claimed and meets the others there.

A replica may itself be tensor / pipeline parallel (parallel.tp, parallel.pp): the mesh's dp axis
then counts the replicas and, last, the servers (sync.ps_servers ranks, tp x pp per server group).
Each position (pp, tp) in a replica holds its part of the model, so each position has its own
windows, served by the server ranks at that position. The replica's first rank (its leader) claims
batches, reads the stop flag, takes the arrival lock (every part sees the arrivals in one order)
and decides the next round's steps; the others get them from it (one broadcast inside the
replica, which steps together anyway).

Hierarchical (sync.replica_nodes = R, hpctrain/sync/async_groups.py): a replica is R nodes of
ranks doing DDP inside (each inner-dp rank trains its slice of every batch its leader claims); the
servers fill the last group(s) of R nodes (sync.ps_servers a multiple of a group's ranks). Only
the inner-dp rank 0 of each position touches the windows: it pulls (catch-up) and arrives, then
broadcasts the new weights and the arrival to its inner-dp peers, which stay bit-identical.
Compressed, the pushers alone hold the inbox (its communicator is my position's pushers and
servers): the encoded push / pull, the push residual and the servers' view of a replica are theirs.
With FSDP inside (parallel.data_parallel = "fsdp") every rank holds one shard and is the pusher of
it: a part of the model is a (position, shard) pair with its own windows (and inbox), served by the
server rank at the same place in the server group, so the global model is sharded like the
replicas; nothing is broadcast inside the replica, the leader still claims, reads the stop flag,
holds the arrival lock and decides the round's steps. An arrival record's bytes are the leader's
part's (as with tp / pp positions).

Owns: the round (local steps, start point, arrival, dynamic step count) and its metrics; its
checkpoint entry is hpctrain/sync/async_state.py. With sync.compression = "bf16" | "int8" | "int4" the replica pushes its encoded
pseudo-gradient and the servers apply it, and it pulls the global model's change since its last
pull in the same format (or sync.pull_compression's), with error feedback on the servers
(hpctrain/sync/inbox.py; sync.defer_momentum_pull: a momentum step rides the next pull; the
last arrival at the end of training pulls nothing; sync.error_feedback, int8 / int4: what a push's
codes left out is added to the replica's next push, checkpointed with the replica). The end of
training cuts a replica's last round short: that arrival applies its share alone, without a
momentum step (outer.py). An arrival then moves 2 (bf16), ~1 (int8) or ~1/2 (int4) bytes per
parameter out and as many back, instead of 24; nothing back when the arrival's change is the
replica's own pseudo-gradient alone (outer SGD, or delayed Nesterov off its momentum arrivals) and
the replica held every arrival before it:
it adds that change itself, as the servers add it to their view of it (inbox.py, outer.OwnChange).
Each arrival's record says pushed_bytes and pulled_bytes (catch-up pulls of the round
included). The servers' view of a replica's weights is its start point: checkpointed with the
replica and sent to the servers again on resume (inbox.set_views).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.mesh import Mesh
from hpctrain.sync.async_groups import ReplicaGroups
from hpctrain.sync.async_state import AsyncCheckpoint
from hpctrain.sync.asynchronous import AsynchronousStrategy, add_into, assign, flat
from hpctrain.sync.global_model import GlobalModelWindows
from hpctrain.sync.inbox import ArrivalInbox
from hpctrain.sync.outer import OwnChange, apply_arrival, dynamic_local_steps
from hpctrain.model.optim import lr_at


class AsyncDiLoCo(AsyncCheckpoint, AsynchronousStrategy):
    mode = "async_diloco"
    every_worker_steps = False  # a step's batch is trained by the replica that claimed it
    count_key = "replicas"

    def __init__(self, cfg: Config, ctx: DistContext, mesh: Mesh, model: torch.nn.Module):
        s = cfg.sync
        self.groups = g = ReplicaGroups(ctx.comm, mesh, s.ps_servers)
        self.positions, self.position, self.leader, self.pusher = g.positions, g.position, g.leader, g.pusher
        self.parts = g.parts  # windows per replica: positions, x inner-dp shards with FSDP inside
        super().__init__(ctx, g.replicas, trains=g.trains)
        self.kind, self.inner_steps, self.dynamic = s.outer_optimizer, s.inner_steps, s.local_steps == "dynamic"
        self.catch_up, self.momentum_per_lr = s.catch_up, s.momentum_per_lr
        self.outer = dict(lr=s.outer_lr, mu=s.outer_momentum, replicas=self.n_workers,
                          delay=s.nesterov_delay or self.n_workers)
        self.params = list(model.parameters())
        self.team, self.pushers = g.team, g.pushers  # my replica's ranks; its inner-dp rank 0s
        self.windows = GlobalModelWindows(g.part_comm, flat(self.params), g.server_groups, self.n_workers,
                                          control_comm=ctx.comm, control_host=g.control_host)
        self.compressed = s.compression != "none"
        pull_kind = None if s.pull_compression == "same" else s.pull_compression
        self.wire_kinds = (s.compression, pull_kind or s.compression, s.error_feedback) if self.compressed else None
        wire = g.wire() if self.compressed else None  # the pushers and servers (None: an inner-dp peer)
        self.inbox = None if wire is None else ArrivalInbox(
            wire[0], wire[1], self.windows.bounds, self.n_workers, s.compression, s.int8_block, pull_kind)
        if self.inbox is not None:  # an arrival whose change is the replica's own: no pull
            self.inbox.own_change = OwnChange(self.kind, **self.outer)
            self.inbox.defer_momentum = s.defer_momentum_pull
        self.flags = self.windows
        self.start = flat(self.params)
        self.replica = g.replica
        if self.inbox is not None:
            self.inbox.set_views(self.replica, self.start if self.trains else None, held=0)
            if s.error_feedback and self.trains:  # what an encoded push left out rides the next one
                self.inbox.push_residual = np.zeros_like(self.start)
        self.round_pulled = 0  # bytes pulled this round before the arrival (catch-ups)
        # checkpoint keys of what differs by part (each rank's part of the model: position, shard)
        part = "" if self.parts == 1 else f"_{g.part}"
        self.state_key, self.outer_key = f"{self.replica}{part}", f"outer{part}"
        self.steps_this_round, self.round_steps = self.inner_steps, 0
        self.claimed, self.last_arrival = -1, 0
        self.round_compute_s, self._t0 = 0.0, 0.0
        self.round_lr_sum, self.train_cfg = 0.0, cfg.train  # the inner lr over the round (outer.py)
        self.round_caught_up = 0  # others' arrivals added to my weights during this round
        self.pending: dict = {}
        self._stash = self._outer = None
        self._arrivals, self._finished, self._step_at_meeting = 0, False, 0
        self._step_times = [0] * self.n_workers
        self.logged_step, self.arrivals_since_line, self.pseudo_grad_norm = 0, 0, 0.0

    @property
    def writes_metrics(self) -> bool:
        return self.trains and self.leader

    @property
    def ranks_per_record(self) -> int:
        """A record counts its replica's tokens (MFU against that replica's ranks)."""
        return self.team.size

    def step_loss(self, loss) -> float:
        # sync.replica_nodes: each inner-dp rank its slice (over MPI: a host number, read here)
        return loss if self.groups.inner_size == 1 else self.groups.mean_inside(float(loss))

    def _from_leader(self, value):
        """The leader's `value` on every rank of the replica (itself when it is one rank)."""
        return value if self.team.size == 1 else self.team.bcast(value, root=0)

    # ---- a replica's step ---------------------------------------------------------------------
    def before_step(self, step: int, stop_aware: bool = True, until: int | None = None) -> bool:
        """Claim the next batch; False when the claim is at or past `until` (a checkpoint step:
        time to meet). The stop flag is not read here: stop_reason() read it after the previous
        step, and the meeting before the first (one remote operation less per step: ~2 ms across
        nodes)."""
        if self.leader:
            claim = self.windows.claim_and_arrivals() if self.catch_up else (self.windows.claim(), 0)
        self.claimed, arrivals = self._from_leader(claim if self.leader else None)
        if until is not None and self.claimed >= until:
            return False
        if arrivals > self.last_arrival:  # others arrived since my pull: add their updates
            self._catch_up(arrivals)
        self._t0 = time.perf_counter()
        return True

    def stop_reason(self, preempt, step: int) -> int:
        preempt.debug_sleep()
        self._raise_if_mine(preempt)
        return self._from_leader(self.flags.stop_flag() if self.leader else None)

    def batch_index(self, step: int) -> int | None:
        return self.claimed

    def next_step(self, step: int) -> int:
        return self.claimed + 1

    def after_step(self, step: int) -> None:
        self.round_compute_s += time.perf_counter() - self._t0
        self.round_lr_sum += lr_at(self.claimed, self.train_cfg)  # the lr this step trained with
        self.round_steps += 1
        self.pending = {}
        if self.round_steps >= self.steps_this_round:
            self._arrive()

    def _catch_up(self, arrivals: int) -> None:
        """Add what the first `arrivals` arrivals changed in the global model since my pull to my
        weights, without waiting for my own arrival: start - local (my pseudo-gradient) stays
        exactly my own work, and the rest of my round trains on a model that holds the others'
        rounds. Every part of a multi-rank replica reads the same arrivals: uncompressed, under the
        arrival lock (an arrival holds it until every part is applied); compressed, once every
        server of the part has applied `arrivals` (later ones may be in too; the next catch-up or
        arrival takes them)."""
        hold, theta = self.parts > 1 and not self.compressed, None
        if hold and self.leader:
            self.windows.hold_arrivals()
        moved = self.windows.bytes_moved
        if self.inbox is not None:
            theta, pulled = self.inbox.pull(self.replica, arrivals, self.start)
            self.windows.bytes_moved += pulled
        elif self.pusher:  # sync.replica_nodes: inner-dp rank 0 pulls, its peers get it from it
            theta = self.windows.pull()
        self.round_pulled += self.windows.bytes_moved - moved
        if hold and self.pusher:
            self.pushers.Barrier()
            if self.leader:
                self.windows.end_arrival()
        theta, _ = self.groups.share(theta, 0, len(self.start))
        add_into(self.params, theta - self.start)  # outer.with_updates_since, without a copy back
        self.start = theta
        self.round_caught_up += arrivals - self.last_arrival
        self.last_arrival = arrivals

    def _arrive(self, last: bool = False) -> None:
        """End the round: push g = start - local; `last` (the end of training, a partial round):
        applied as its share alone, no momentum step (outer.py), and compressed, pull nothing back
        (the checkpoint takes the global model from the servers)."""
        g = self.start - flat(self.params)
        self.arrivals_since_line += 1
        if self.leader:  # this position's part of the pseudo-gradient, for the round line
            self.pseudo_grad_norm = float(np.linalg.norm(g))
        # delayed Nesterov's momentum in units of inner lr (outer.py), or plain sums (lr_scale 1)
        lr_scale = max(self.round_lr_sum / self.round_steps, 1e-12) if self.momentum_per_lr else 1.0

        def apply(theta, momentum, acc, g_slice, arrival):  # the last, partial round: its share only
            apply_arrival(self.kind, theta, momentum, acc, g_slice, arrival, **self.outer, lr_scale=lr_scale,
                          final=last)

        t0, moved = time.perf_counter(), self.windows.bytes_moved
        arrival = theta = None
        if self.compressed:
            arrival, theta, pushed = self._arrive_compressed(g, lr_scale, last)
        elif self.parts == 1 and self.pusher:
            arrival, theta = self.windows.arrive(g, apply)
        elif self.pusher:  # every part of the model, in the order the leader's lock gives
            arrival, theta = self.windows.arrive(
                g, apply, self.pushers.bcast(self.windows.begin_arrival() if self.leader else None, root=0))
            self.pushers.Barrier()
            if self.leader:
                self.windows.end_arrival()
        theta, arrival = self.groups.share(theta, arrival, len(g))  # to the inner-dp peers
        arrival_bytes = self.windows.bytes_moved - moved
        if not self.compressed:
            pushed = arrival_bytes // 2  # theta, momentum, accumulator read, then written back
        arrive_s = time.perf_counter() - t0
        assign(self.params, theta)  # the replica goes on from the global model
        self.start = theta
        step_s = self.round_compute_s / self.round_steps
        self.pending = {"arrival": arrival, "replica": self.replica, "local_steps": self.round_steps,
                        "staleness": arrival - 1 - self.last_arrival, "caught_up": self.round_caught_up,
                        "round_step_s": step_s,
                        "arrive_s": arrive_s, "arrival_bytes": arrival_bytes, "pushed_bytes": pushed,
                        "pulled_bytes": arrival_bytes - pushed + self.round_pulled}
        self.last_arrival = arrival
        if self.leader:
            self.windows.set_step_time(self.replica, step_s)
            if self.dynamic:
                times = self.windows.step_times()
                self.steps_this_round = dynamic_local_steps(self.inner_steps, step_s, float(times[times > 0].min()))
        self.steps_this_round = self._from_leader(self.steps_this_round)
        self.pending["next_local_steps"] = self.steps_this_round
        self.round_steps, self.round_compute_s, self.round_lr_sum, self.round_caught_up = 0, 0.0, 0.0, 0
        self.round_pulled = 0

    def _arrive_compressed(self, g, lr_scale: float, last: bool = False):
        """Post the encoded pseudo-gradient, pull the change once applied; (arrival, theta, bytes
        pushed). `last`: no pull, theta = my weights (on resume, my view: nothing counted twice)."""
        arrival = self._from_leader(self.windows.count_arrival() if self.leader else None)
        if self.inbox is None:  # sync.replica_nodes: an inner-dp peer gets theta from its pusher
            return arrival, None, 0
        pushed = self.inbox.post(self.replica, arrival, g, lr_scale, final=last)
        if last:
            self.inbox.wait_applied(arrival)
            self.windows.bytes_moved += pushed
            return arrival, flat(self.params), pushed
        theta, pulled = self.inbox.pull(self.replica, arrival, self.start)
        self.windows.bytes_moved += pushed + pulled
        return arrival, theta, pushed

    def serve(self) -> None:
        """Server ranks, while they wait in a meeting: apply the compressed arrivals posted."""
        if self.inbox is None or self.trains:
            return

        def apply(g_slice, arrival, lr_scale, final):
            self.windows.apply_here(lambda theta, momentum, acc: apply_arrival(
                self.kind, theta, momentum, acc, g_slice, arrival, **self.outer, lr_scale=lr_scale, final=final))

        def theta() -> np.ndarray:
            out = []
            self.windows.apply_here(lambda theta, momentum, acc: out.append(theta.copy()))
            return out[0]

        self.inbox.serve(apply, theta)

    def step_metrics(self) -> dict:
        return dict(self.pending)

    def comm_bytes(self, step: int) -> int:
        return self.windows.bytes_moved

    def round_line(self, step: int, log_interval: int) -> str | None:
        """This replica's last arrival (rank 0 logs: replica 0's), at most one per log_interval."""
        p = self.pending
        if "arrival" not in p or not (self._finished or step // log_interval > self.logged_step // log_interval):
            return None
        line = (f"async_diloco arrival {p['arrival']} of replica {p['replica']} at step {step}: "
                f"{p['local_steps']} local steps, pseudo-grad norm {self.pseudo_grad_norm:.4g}, "
                f"staleness {p['staleness']}, caught up {p['caught_up']}, "
                f"{p['arrival_bytes'] / 2**20:.3g} MiB moved, arrival took {p['arrive_s']:.3f} s "
                f"({self.arrivals_since_line} arrival(s) of this replica since the last line)")
        self.logged_step, self.arrivals_since_line = step, 0
        return line

    def describe(self) -> str:
        return (f", sync async_diloco: {self.n_workers} replicas of {self.team.size} rank(s), "
                f"{self.ctx.world_size - self.n_workers * self.team.size} servers, {'dynamic' if self.dynamic else 'fixed'} local steps "
                f"(<= {self.inner_steps}), {self._wire()}"
                f"{', catch-up' if self.catch_up else ''}, H={self.inner_steps} outer={self.kind} "
                f"lr={self.outer['lr']:g} m={self.outer['mu']:g}")

    def _wire(self) -> str:
        """The wire formats, as describe() names them: 'int8 pushes' or 'int8 pushes, int4 pulls'."""
        push, pull, feedback = self.wire_kinds or ("fp32", "fp32", False)
        kinds, feedback = (push, pull), " with error feedback" if feedback else ""
        return f"{kinds[0]} pushes{feedback}" + ("" if kinds[1] == kinds[0] else f", {kinds[1]} pulls")

    # ---- the end of training, checkpoints --------------------------------------------------------
    def meet(self, preempt, step: int, stop: int, end: int) -> tuple[int, int]:
        step, stop = super().meet(preempt, step, stop, end)
        self._finished, self._step_at_meeting = step >= end, step
        self.pending = {}
        if self._finished and self.trains and self.round_steps > 0:
            self._arrive(last=True)  # the last, partial round: the global model holds all work
        if self._finished and self.compressed:  # servers apply those last arrivals
            done = self.ctx.comm.Ibarrier()
            while not done.Test():
                self.serve()
                time.sleep(0.0005)
        return step, stop

    def meeting_metrics(self) -> dict:
        return dict(self.pending)

    def close(self) -> None:
        self.windows.free()
        if self.inbox is not None:
            self.inbox.free()
