"""What the MPI training tests share: their two GPT configs, writing a run's TOML, training it
under a real mpiexec (1 rank: plain python), the layouts of the parity tests, the curve check, the
held-out loss of a run's checkpoints and the meta-init probe.

The session's dataset, `records` / `losses` and the TOML sections live in tests/conftest.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import ROOT, RUN_DATA, TINY_SECTIONS, losses, model_section, mpirun, run_cmd

# A 2-layer, 64-wide GPT for 40 steps with validation and checkpoints every 10 (tests/mpi/test_train.py
# and the sync-mode modules): SMALL_GPT.format(run=..., data=...).
SMALL_GPT = RUN_DATA + model_section() + """[train]
steps = 40
micro_batch_size = 4
grad_accum = 1
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
eval_interval = 10
eval_batches = 2
log_interval = 10
[checkpoint]
interval = 10
keep = 2
"""

# The layout-parity GPT (4 blocks, 64 wide, 32 tokens), 8 sequences per step in every layout:
# micro_batch x grad_accum x dp = 8 (tests/mpi/test_parallel_parity.py).
PARITY_GPT = RUN_DATA + 'verify = "size"\n' + model_section(n_layer=4, n_head=4, block_size=32) + """[train]
steps = 20
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
eval_interval = 0
log_interval = 10
[checkpoint]
interval = 10
keep = 2
"""

# name: (ranks, overrides); every layout keeps PARITY_GPT's global batch at 8 sequences.
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
LAYOUTS = {
    "dp2": (2, ["--train.grad_accum=1"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "tp2": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]),
    "pp2_gpipe": (2, PP + ["--parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": (2, PP + ["--parallel.pp_schedule=1f1b"]),
    "pp2_interleaved": (2, PP + ["--parallel.pp_schedule=interleaved", "--parallel.pp_virtual_stages=2"]),
    "dp2_tp2": (4, ["--parallel.tp=2", "--train.grad_accum=1"]),
    "fsdp2_tp2": (4, ["--parallel.tp=2", "--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "pp2_dp2": (4, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=2"]),
    "pp2_tp2": (4, PP + ["--parallel.tp=2"]),
    "dp2_ac_selective": (2, ["--train.grad_accum=1", "--parallel.activation_checkpoint=selective",
                             "--parallel.ac_every=2"]),
    # torch.compile (fused kernels round differently from eager, well inside the 1e-5 bound)
    "dp2_compile": (2, ["--train.grad_accum=1", "--train.compile=true",  # the whole model under DDP
                        "--train.compile_scope=model"]),
    "fsdp2_compile": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1", "--train.compile=true"]),
    "tp2_compile": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1",
                        "--train.compile=true"]),
}


# The fault-tolerance GPT: 6 steps, a fully checksummed checkpoint every 2, a 10 s heartbeat.
FAULT_GPT = RUN_DATA + 'verify = "size"\n' + model_section() + """[train]
steps = 6
micro_batch_size = 4
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
eval_interval = 0
log_interval = 1
[checkpoint]
interval = 2
keep = 1
full_checksums = true
[dist]
heartbeat_timeout_s = 10
"""



# Preemption runs: the 1-layer TINY_SECTIONS model, 24 steps, no checkpoint but the one a stop writes.
PREEMPT_GPT = TINY_SECTIONS + """[train]
steps = 24
micro_batch_size = 2
warmup_steps = 2
eval_interval = 0
log_interval = 100
[checkpoint]
interval = 1000
"""


def write_config(tmp_path, data, name="run", template=SMALL_GPT):
    """(tmp_path/NAME.toml, tmp_path/NAME): a config from `template` and the run dir it names."""
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(template.format(run=run, data=data))
    return cfg, run


def fault_config(tmp_path, data, name="run"):
    """write_config of FAULT_GPT."""
    return write_config(tmp_path, data, name, FAULT_GPT)


def slow_steps(tmp_path, step_sleep_s=0.25):
    """(file, env): HPCTRAIN_TEST_FAULTS=@FILE with step_sleep_s, steps slow enough for a signal
    to land mid-run. A run reads the file once, at start-up: `fast_from_the_next_run(file)` right
    after the signal or node loss spares the runs after it (a requeued or relaunched job keeps its
    environment) the sleep."""
    from hpctrain import step_faults

    faults = Path(tmp_path) / "faults.txt"
    faults.write_text(f"step_sleep_s={step_sleep_s:g}")
    return faults, {step_faults.ENV: f"@{faults}"}


def fast_from_the_next_run(faults: Path) -> None:
    faults.write_text("step_sleep_s=0")


def train(n, cfg, *overrides, check=True, timeout=600, env=None):
    """`hpctrain train --config CFG OVERRIDES` on n ranks (n = 1: without mpiexec); `env` adds to
    the environment (step_faults.env(...): test faults)."""
    args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
    if n == 1:
        return run_cmd([sys.executable, *args], timeout=timeout, check=check, env=env)
    return mpirun(n, args, timeout=timeout, check=check, env=env)


def train_layout(n, tmp, data, name, *overrides, check=True, timeout=300):
    """Train PARITY_GPT (written once per name) as tmp/NAME on n ranks: (process, run dir)."""
    run = Path(tmp) / name
    cfg = Path(tmp) / f"{name}.toml"
    if not cfg.exists():
        cfg.write_text(PARITY_GPT.format(run=run, data=data))
    return train(n, cfg, *overrides, check=check, timeout=timeout), run


def shared_layout_run(tmp_path_factory, data, name: str) -> tuple[str, Path]:
    """(its stderr, run dir) of PARITY_GPT trained as `name` ("one": 1 rank, else a LAYOUTS
    entry), once per session (tests/shared_dirs.py): test_parallel_parity.py's curves, which
    test_meta_init.py also reads as its parallel.meta_init = true runs. Read-only."""
    from tests.shared_dirs import shared_dir

    n, overrides = (1, []) if name == "one" else LAYOUTS[name]

    def build(out):
        r, _ = train_layout(n, out, data, name, *overrides)
        (out / "stderr.txt").write_text(r.stderr)
    out = shared_dir(tmp_path_factory, f"parity_{name}", build)
    return (out / "stderr.txt").read_text(), out / name


def assert_same_curve(ref, got, steps):
    """`got` has exactly `steps`, each within 1e-5 (relative) of `ref`."""
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, ref[s], got[s])


def assert_equal_runs(run_a, run_b, steps: int, learns_by: float, tol: float = 1e-5) -> dict:
    """Runs a and b logged steps 1..`steps` with losses within `tol` (and the same validation
    steps, val losses within `tol`), and a's loss fell by more than `learns_by`. Returns a's
    {step: val_loss}."""
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert a[steps] < a[1] - learns_by, (a[1], a[steps])  # it learns
    for step in a:
        assert abs(a[step] - b[step]) <= tol, (step, a[step], b[step])
    va, vb = losses(run_a, "val_loss"), losses(run_b, "val_loss")
    assert va.keys() == vb.keys() and all(abs(va[s] - vb[s]) <= tol for s in va), (va, vb)
    return va


def held_out_losses(run, data, windows=64) -> dict:
    """{step: held-out loss of the global model in that step's checkpoint}, on fixed windows."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from hpctrain.checkpoint import directory
    from hpctrain.data import open_split
    from hpctrain.export import load_model_state
    from hpctrain.model import build_model_from_section

    out = {}
    for info in directory.list_checkpoints(Path(run) / "checkpoints"):
        state, model_cfg = load_model_state(info.path)
        model = build_model_from_section(model_cfg).eval()
        model.load_state_dict(state)
        val = open_split(data, "val", model_cfg["block_size"])
        chunk = torch.as_tensor(val.batch(np.linspace(0, len(val) - 1, windows).astype(np.int64)), dtype=torch.long)
        with torch.no_grad():
            out[info.step] = F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten()).item()
    return out


# builds the tiny GPT with and without meta init in each layout and compares the weights
PROBE = ROOT / "tests" / "mpi" / "scripts" / "meta_init_probe.py"


def probe(n: int, layouts: dict[str, str]) -> None:
    r = mpirun(n, [PROBE, *(f"{k}={v}" for k, v in layouts.items())], timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith(("SAME", "DIFF"))]
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [l for l in lines if l.startswith("DIFF")], "\n".join(lines)
    got = sorted((l.split()[1], int(l.split()[2])) for l in lines)
    assert got == sorted((k, rank) for k in layouts for rank in range(n)), lines


def copy_run_at(src: Path, dst: Path, step: int) -> None:
    """dst: a copy of run dir `src` as it was right after its checkpoint of `step` (the later
    checkpoints and metrics.jsonl's later records removed): rerunning on it resumes from `step`,
    so a straight run's copy is the interrupted run of an exact-resume comparison."""
    import json
    import shutil

    from hpctrain.checkpoint.disk_format import parse_dir_name

    shutil.copytree(src, dst)
    for later in Path(dst, "checkpoints").glob("step_*"):
        parsed = parse_dir_name(later.name)  # step_N, and step_N.tmp-<launch id> a kill left
        if parsed is None or parsed[0] > step or parsed[1] != "checkpoint":
            shutil.rmtree(later)
    metrics = Path(dst, "metrics.jsonl")
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step", 0) <= step))
