"""Profile windows (hpctrain/metrics/profiling.py): the [metrics] keys' checks, when a window begins
and ends (fresh, resumed inside, resumed past it, stopped inside), a real torch.profiler trace of
steps A..B only, nothing built outside the window, and the CUDA memory snapshot's refusal on CPUs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.metrics import profiling


def make_cfg(tmp_path, steps=20, **metrics):
    raw = {"run": {"dir": str(tmp_path / "run")}, "data": {"path": "/nowhere"},
           "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257},
           "train": {"steps": steps, "micro_batch_size": 2, "warmup_steps": 0}, "metrics": metrics}
    return config.from_dict(raw)


@pytest.mark.parametrize("key", ["profile_steps", "memory_snapshot_steps"])
@pytest.mark.parametrize("value", ["10", "12-10", "0-3", "a-b", "10-12-14", "3-21", "-3"])
def test_a_bad_step_range_is_one_error_naming_the_key(tmp_path, key, value):
    with pytest.raises(ConfigError) as e:
        make_cfg(tmp_path, **{key: value})
    assert str(e.value) == (f"config key 'metrics.{key}': {value!r}: expected 'A-B', training steps "
                            f"1 <= A <= B <= train.steps=20 (e.g. '10-12'), or '' (off)")


def test_good_step_ranges(tmp_path):
    cfg = make_cfg(tmp_path, profile_steps=" 10 - 12", memory_snapshot_steps="20-20")
    assert (cfg.metrics.profile_steps, cfg.metrics.memory_snapshot_steps) == (" 10 - 12", "20-20")
    assert profiling.step_range(cfg.metrics.profile_steps, 20) == (10, 12)


def test_a_memory_snapshot_on_a_cpu_rank_is_refused_at_start(tmp_path):
    cfg = make_cfg(tmp_path, memory_snapshot_steps="5-6")
    with pytest.raises(ConfigError) as e:
        profiling.windows(cfg, 0, "cpu")
    assert str(e.value).startswith("config key 'metrics.memory_snapshot_steps': '5-6' needs CUDA, and "
                                   "this run trains on the cpu: set it to ''")
    (w,) = profiling.windows(cfg, 3, "cuda")  # the plumbing only: CUDA is touched at the window
    assert isinstance(w, profiling.MemoryWindow) and (w.first, w.last, w.rank) == (5, 6, 3)
    assert profiling.windows(make_cfg(tmp_path), 0, "cpu") == []


class Recorder(profiling.StepWindow):
    warmup = 1

    def __init__(self, first, last):
        super().__init__(first, last, Path("/nowhere"), 0)
        self.calls = []

    def _begin(self, step):
        self.calls.append(("begin", step))

    def _each(self, step):
        self.calls.append(("each", step))

    def _end(self, step):
        self.calls.append(("end", step))


def run_steps(window, start, stop, close=True):
    window.start(start)
    for step in range(start + 1, stop + 1):
        window.after_step({"step": step})
    if close:
        window.close()
    return window.calls


@pytest.mark.parametrize("first,start,stop,calls", [
    (10, 0, 20, [("begin", 9), ("each", 9), ("each", 10), ("each", 11), ("each", 12), ("end", 12)]),
    (10, 10, 20, [("begin", 11), ("each", 11), ("each", 12), ("end", 12)]),  # resumed inside
    (10, 12, 20, []),  # resumed past it
    (10, 0, 11, [("begin", 9), ("each", 9), ("each", 10), ("each", 11), ("end", 11)]),  # stopped inside
    (1, 0, 20, [("begin", 1), ("each", 1), ("each", 2), ("each", 3), ("each", 4), ("each", 5),
                ("each", 6), ("each", 7), ("each", 8), ("each", 9), ("each", 10), ("each", 11),
                ("each", 12), ("end", 12)]),  # from step 1: no warmup step before it
])
def test_window_begins_and_ends(first, start, stop, calls):
    assert run_steps(Recorder(first, 12), start, stop) == calls


def test_a_trace_holds_the_window_steps_only_and_nothing_is_built_outside(tmp_path, monkeypatch):
    built = []
    real = torch.profiler.profile
    monkeypatch.setattr(torch.profiler, "profile", lambda **kw: built.append(real(**kw)) or built[-1])
    window = profiling.TraceWindow(3, 4, tmp_path, 1, cuda=False, record_shapes=False, with_stack=False)
    window.start(0)
    assert window.prof is None
    x = torch.randn(64, 64)
    for step in range(1, 9):
        with torch.profiler.record_function(f"work_{step}"):
            (x @ x).sum()
        window.after_step({"step": step})
        assert (window.prof is not None) == (1 <= step <= 3), step  # built for step 2 (warmup), dropped after 4
    window.close()
    assert len(built) == 1
    trace = json.loads((tmp_path / "rank_1_steps_3-4.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
    assert {n for n in names if n.startswith("work_")} == {"work_3", "work_4"}
    assert [p.name for p in tmp_path.iterdir()] == ["rank_1_steps_3-4.json"]
