"""`hpctrain tune`: hyperparameter search over Slurm job arrays (docs/tuning.md).

space.py (the [tune] section; torch- and optuna-free), study.py (the Optuna study in a journal
file, claiming trials), locks.py (lock files on the shared file system), trial_run.py (one trial's
training, reported and pruned), search.py (the worker loop), status.py (the table of trials and
the best configuration), cli.py (the commands).
"""
