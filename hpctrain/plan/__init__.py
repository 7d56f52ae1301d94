"""The scale planner behind `python -m hpctrain plan`: per-rank memory, communication, checkpoint
and data-pipeline figures of a model shape and layout on a cluster we cannot run here.

Pure arithmetic over the shapes of OUR code (hpctrain/model/<arch>/, hpctrain/parallel/,
hpctrain/train/, hpctrain/data/sampler.py, hpctrain/checkpoint/): each module says which code its
formulas follow. Modules: shape.py (model shapes, parameter counts, presets), layout.py (the job:
cluster, parallel layout, budgets), memory.py (bytes per rank), comm.py (bytes per step per link),
storage.py (sampler, node cache, checkpoints), report.py (tables and warnings), step_time.py (a
modelled step time), search.py (the layouts that fit, ranked), recommend.py (the `recommended:`
advice), cli.py (argparse).
It must never import torch at module level, start MPI or touch a dataset.
"""
