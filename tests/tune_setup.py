"""What the `hpctrain tune` tests share: a small byte-level dataset with a validation split, a
training TOML with a [tune] section, and a study whose trials' values are fixed in advance
(enqueued), so that which trial fails or is pruned does not depend on the sampler."""
from __future__ import annotations

import sys

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
[debug]
step_sleep_s = {sleep}
[tune]
n_trials = {n_trials}
pruner = "{pruner}"
prune_startup_trials = 1
[tune.params]
train.lr = {{ log_uniform = [1e-6, 1e-2] }}
debug.inject_nan_at_step = {{ choice = [0, 3] }}
"""


def make_dataset(out):
    from data_tools.corpora import shakespeare_files

    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:4],
             "--output", out, "--tokenizer", "bytes", "--val-fraction", "0.25", "--no-progress"],
            timeout=120, check=True)
    return out


def write_study(tmp_path, data, points, pruner="none", sleep=0.0):
    """CONFIG.toml for a study in tmp_path/study whose trial n gets points[n] = (lr, nan_step)."""
    from hpctrain.tune.search import load
    from hpctrain.tune.study import open_study

    cfg = tmp_path / "tune.toml"
    cfg.write_text(TUNE_TOML.format(run=tmp_path / "study", data=data, sleep=sleep,
                                    n_trials=len(points), pruner=pruner))
    _, tune, _ = load(str(cfg), [])
    study = open_study(tune)
    for lr, nan_step in points:
        study.enqueue_trial({"train.lr": lr, "debug.inject_nan_at_step": nan_step})
    return cfg, tune


def trials(tune):
    from hpctrain.tune.study import load_study

    return load_study(tune.journal).get_trials(deepcopy=False)
