"""What the `hpctrain tune` tests share: a small byte-level dataset with a validation split, a
training TOML with a [tune] section, a study whose trials' values are fixed in advance
(enqueued), so that which trial is pruned does not depend on the sampler, and the test faults a
search worker passes on to every trial (one trial's training crashes at step 3 on cue)."""
from __future__ import annotations

import sys

from hpctrain import step_faults
from tests.conftest import TINY_SECTIONS, run_cmd

STEPS = 16
TUNE_TOML = TINY_SECTIONS + """[train]
steps = 16
micro_batch_size = 2
warmup_steps = 0
eval_interval = 4
eval_batches = 2
log_interval = 4
max_bad_steps = 1
[checkpoint]
interval = 1000
[tune]
n_trials = {n_trials}
pruner = "{pruner}"
prune_startup_trials = 1
[tune.params]
train.lr = {{ log_uniform = [1e-6, 1e-2] }}
"""


def make_dataset(out):
    from data_tools.corpora import shakespeare_files

    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:4],
             "--output", out, "--tokenizer", "bytes", "--val-fraction", "0.25", "--no-progress"],
            timeout=120, check=True)
    return out


def write_study(tmp_path, data, lrs, pruner="none"):
    """CONFIG.toml for a study in tmp_path/study whose trial n gets train.lr = lrs[n]."""
    from hpctrain.tune.search import load
    from hpctrain.tune.study import open_study

    cfg = tmp_path / "tune.toml"
    cfg.write_text(TUNE_TOML.format(run=tmp_path / "study", data=data, n_trials=len(lrs), pruner=pruner))
    _, tune, _ = load(str(cfg), [])
    study = open_study(tune)
    for lr in lrs:
        study.enqueue_trial({"train.lr": lr})
    return cfg, tune


def worker_faults(sleep: float, failing: int | None = None) -> dict[str, str]:
    """The environment of a search worker whose trials sleep `sleep` s per step and whose trial
    `failing` gets a NaN loss at step 3 (with train.max_bad_steps = 1: exit status 2)."""
    nan = {} if failing is None else {"inject_nan_at_step": 3, "nan_trial": failing}
    return step_faults.env(step_sleep_s=sleep, **nan)


def trials(tune):
    from hpctrain.tune.study import load_study

    return load_study(tune.journal).get_trials(deepcopy=False)
