"""Profiles over a window of training steps, on every training rank: a torch.profiler Chrome trace
(`metrics.profile_steps = "A-B"`) and a CUDA allocator snapshot (`metrics.memory_snapshot_steps`).

Owns: when each window begins and ends (the loop's "start", "after_step" and "end_of_run" hooks,
train/hooks.py) and the files, in `<run.dir>/profile/`:

  rank_<r>_steps_A-B.json           torch.profiler over steps A..B (CPU, + CUDA on GPUs), one warmup
                                    step before A (none before step 1); its "ProfilerStep#N" spans
                                    are training steps N. Open in chrome://tracing or Perfetto.
  memory_rank_<r>_steps_A-B.pickle  torch.cuda.memory._record_memory_history from before step A,
                                    dumped after step B (drag into https://pytorch.org/memory_viz).

Outside its window a profile costs one integer comparison per step: the profiler is built right
before its first (warmup) step and dropped after its last, and neither changes a number of the
training. A run resumed inside a window profiles the rest of it (the file names the steps it
holds); a run stopped inside one (a preemption) writes what it has at the end of the run. A memory
snapshot needs CUDA: a rank that trains on the CPU refuses it at start, with one error line.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from hpctrain import logs
from hpctrain.config_rules import step_range
from hpctrain.errors import ConfigError

log = logs.get_logger(__name__)


class StepWindow:
    """Training steps first..last (`warmup` steps before first begin it): `_begin(step)` before
    the window's first step, `_each(step)` after each of its steps, `_end(step)` after the last
    one run (`last`, or the run's last step when it stops inside the window)."""

    warmup = 0

    def __init__(self, first: int, last: int, out_dir: Path, rank: int):
        self.first, self.last, self.out_dir, self.rank = first, last, out_dir, rank
        self.begin_at = max(first - self.warmup, 1)  # the first step the window runs around
        self.active, self.done = False, 0  # inside the window; the last step done

    def start(self, step: int) -> None:
        """The run starts after `step` (0 or the step it resumed from)."""
        self.done = step
        self._maybe_begin(step)

    def after_step(self, record: dict) -> None:
        step = record["step"]
        if not self.active:
            self._maybe_begin(step)  # outside: one comparison (two at most)
            return
        self.done = step
        self._each(step)
        if step >= self.last:
            self.active = False
            self._end(step)

    def close(self) -> None:
        """The end of the run: a window still open (the run stopped inside it) ends here."""
        if self.active:
            self.active = False
            self._end(self.done)

    def _maybe_begin(self, done: int) -> None:
        if self.begin_at <= done + 1 <= self.last:
            self.active = True
            self.begin_at = self.last + 1  # once
            self._begin(done + 1)

    def _begin(self, step: int) -> None:
        raise NotImplementedError

    def _each(self, step: int) -> None:
        pass

    def _end(self, step: int) -> None:
        raise NotImplementedError

    def path(self, kind: str, first: int, last: int, suffix: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / f"{kind}rank_{self.rank}_steps_{first}-{last}{suffix}"


class TraceWindow(StepWindow):
    """torch.profiler with a schedule (skip_first = the step it begins at, so that ProfilerStep#N
    is training step N; warmup; active = the recorded steps; once)."""

    warmup = 1

    def __init__(self, first, last, out_dir, rank, cuda: bool, record_shapes: bool, with_stack: bool):
        super().__init__(first, last, out_dir, rank)
        self.options = dict(record_shapes=record_shapes, with_stack=with_stack)
        self.cuda, self.prof, self.recorded = cuda, None, first

    def _begin(self, step: int) -> None:
        import torch.profiler as tp

        self.recorded = max(step, self.first)  # a resume inside the window records the rest
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
        with warnings.catch_warnings():  # warmup 0 before step 1 (or on a resume): said in the docs
            warnings.simplefilter("ignore")
            schedule = tp.schedule(skip_first=step, wait=0, warmup=self.recorded - step,
                                   active=self.last - self.recorded + 1, repeat=1)
        self.prof = tp.profile(activities=activities, schedule=schedule, on_trace_ready=self._save,
                               **self.options)
        self.prof.step_num = step - 1  # step() below moves it to `step`: ProfilerStep#<step>
        self.prof.start()
        self.prof.step()

    def _each(self, step: int) -> None:
        self.prof.step()  # after the last recorded step: stops the trace and saves it

    def _end(self, step: int) -> None:
        prof, self.prof = self.prof, None
        prof.stop()  # inside the window (the run stopped there): saves what was recorded

    def _save(self, prof) -> None:
        path = self.path("", self.recorded, self.done, ".json")
        prof.export_chrome_trace(str(path))
        log.info(f"profile: steps {self.recorded}-{self.done} of rank {self.rank} -> {path}")


class MemoryWindow(StepWindow):
    """The CUDA caching allocator's history (allocations with their Python stacks) over the window."""

    def _begin(self, step: int) -> None:
        import torch

        self.recorded = step
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def _end(self, step: int) -> None:
        import torch

        path = self.path("memory_", self.recorded, step, ".pickle")
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info(f"profile: CUDA memory snapshot of steps {self.recorded}-{step} of rank {self.rank} -> {path}")


MAX_ENTRIES = 200_000  # allocator events kept (the newest): ~100 MB of snapshot at most


def windows(cfg, rank: int, device_type: str) -> list[StepWindow]:
    """The profile windows the run's [metrics] section asks for (the keys were checked by
    config_rules); ConfigError for a memory snapshot on a rank without CUDA."""
    m, steps, out = cfg.metrics, cfg.train.steps, Path(cfg.run.dir) / "profile"
    found = []
    if m.profile_steps:
        first, last = step_range(m.profile_steps, steps)
        found.append(TraceWindow(first, last, out, rank, device_type == "cuda", m.profile_record_shapes,
                                 m.profile_with_stack))
    if m.memory_snapshot_steps:
        if device_type != "cuda":
            raise ConfigError(f"config key 'metrics.memory_snapshot_steps': {m.memory_snapshot_steps!r} "
                              f"needs CUDA, and this run trains on the {device_type}: set it to '' (or "
                              f"train on GPUs: dist.backend = 'auto' or 'nccl')")
        found.append(MemoryWindow(*step_range(m.memory_snapshot_steps, steps), out, rank))
    return found


def attach(trainer) -> None:
    """Hook the run's profile windows into the trainer's loop (before training: a refusal is said
    at start)."""
    for window in windows(trainer.cfg, trainer.ctx.rank, trainer.ctx.device.type):
        trainer.hooks.add("start", lambda w=window: w.start(trainer.step))
        trainer.hooks.add("after_step", window.after_step)
        trainer.hooks.add("end_of_run", window.close)
