"""`python -m hpctrain tune status STUDY_JOURNAL`: the table of trials and the best configuration.

Owns: reading a study (never writing to it), one row per trial (number, state, value, steps
trained, values), and the best trial's configuration as a ready-to-run TOML: the base config the
search started from, its overrides, the best values, run.dir = <study dir>/best. It must never
launch or change trials.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hpctrain.tune import space
from hpctrain.tune.study import load_study
from hpctrain.tune.trial_run import last_step


# overrides that belong to the worker's job, not to the configuration (tune.sbatch gives each
# array task its own node-local cache directory): left out of the best configuration
PER_JOB = ("--data.cache_dir=",)


def rows(study) -> list[dict]:
    out = []
    for t in study.get_trials(deepcopy=False):
        steps = t.user_attrs.get("steps")
        if steps is None or t.state.name == "RUNNING":  # still training: its metrics so far
            run_dir = t.user_attrs.get("run_dir")
            steps = last_step(Path(run_dir) / "metrics.jsonl") if run_dir else 0
        out.append({"number": t.number, "state": t.state.name, "value": t.value, "steps": steps,
                    "params": dict(t.params), "error": t.user_attrs.get("error", "")})
    return out


def table(study) -> str:
    lines = [f"{'trial':>5}  {'state':<8} {'val_loss':>9} {'steps':>6}  values"]
    for r in rows(study):
        value = "-" if r["value"] is None else f"{r['value']:.4f}"
        text = " ".join(space.overrides(r["params"]))
        error = f"  ({r['error']})" if r["error"] else ""
        lines.append(f"{r['number']:>5}  {r['state']:<8} {value:>9} {r['steps']:>6}  {text}{error}")
    counts: dict[str, int] = {}
    for r in rows(study):
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials yet")
    return "\n".join(lines)


def best_toml(study, journal: Path) -> str | None:
    """The base config with the best trial's values, as a TOML `hpctrain train` runs (None: no
    COMPLETE trial yet)."""
    from hpctrain import config

    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not done:
        return None
    best = min(done, key=lambda t: t.value)
    base = study.user_attrs.get("base", {})
    raw = config.tomllib.loads(base.get("toml", ""))
    raw.pop("tune", None)
    given = [o for o in base.get("overrides", []) if not o.startswith(PER_JOB)]
    extra = [*given, *space.overrides(best.params), f"--run.dir={journal.parent / 'best'}"]
    for section, values in config.parse_overrides(extra).items():
        raw.setdefault(section, {}).update(values)
    cfg = config.from_dict(raw, f"the best trial of {journal}")
    head = (f"# best trial {best.number} of study '{study.study_name}' ({journal}): "
            f"val_loss {best.value:.6g} after {best.user_attrs.get('steps', '?')} steps\n"
            f"# its values: {' '.join(space.overrides(best.params))}\n"
            f"# base config: {base.get('config', '?')}\n")
    return head + config.to_toml(cfg)


def status(journal: str, study_name: str | None = None, toml_out: str | None = None) -> int:
    journal_path = Path(journal).resolve()
    study = load_study(journal_path, study_name)
    print(f"study '{study.study_name}' in {journal_path}")
    print(table(study))
    toml = best_toml(study, journal_path)
    if toml is None:
        print("no COMPLETE trial yet: no best configuration")
        return 0
    if toml_out:
        Path(toml_out).write_text(toml)
        print(f"best configuration -> {toml_out} (python -m hpctrain train --config {toml_out})")
    else:
        print("\n# ---- best configuration: save as best.toml; python -m hpctrain train "
              "--config best.toml")
        sys.stdout.write(toml)
    return 0
