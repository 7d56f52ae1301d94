"""configs/llama_shakespeare.toml, the 10-20M-parameter Llama recipe on GPT-2-tokenized
Shakespeare (`make llama-demo`), runs as shipped under mpiexec -n 2 for 3 steps: its parameter count
is in the 10-20M the recipe promises and its loss is finite and falls. The full run (350 steps,
<= 10 minutes on 2 cores, then `hpctrain sample`) is `make llama-demo`; its numbers are in the
config's comments.
"""
import math
import re

import pytest

from tests.conftest import losses, mpirun

pytestmark = pytest.mark.mpi


def test_recipe_trains_3_steps_with_10_to_20M_params(tmp_path, gpt2_two_plays, root):
    run = tmp_path / "run"
    r = mpirun(2, ["-m", "hpctrain", "train", "--config", root / "configs" / "llama_shakespeare.toml",
                   f"--run.dir={run}", f"--data.path={gpt2_two_plays}", "--data.verify=size",
                   "--train.steps=3", "--train.warmup_steps=1", "--train.eval_interval=0",
                   "--train.log_interval=1", "--checkpoint.interval=1000"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    params = float(re.search(r"training: ([\d.]+)M params", r.stdout + r.stderr).group(1))
    assert 10.0 <= params <= 20.0, params
    got = losses(run)
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values()), got
    assert got[3] < got[1] - 0.1, got
