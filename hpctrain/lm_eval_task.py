"""A small lm-evaluation-harness task made here from real text, no hub download: "which line comes
next?" multiple choice. Each item is a line of the text (the context) and four candidate lines:
the one that follows it and three drawn from elsewhere in the text; lm_eval scores each candidate's
log-likelihood after the context and counts the item right when the true line scores highest
(`acc`).

    python -m hpctrain.lm_eval_task --text PLAY.txt --output tasks/ [--items 200]

writes tasks/next_line.jsonl (the items) and tasks/next_line.yaml (the task, reading the JSONL with
the `datasets` package's local json loader: works with HF_DATASETS_OFFLINE=1); then
`lm_eval run --include_path tasks/ --tasks next_line ...` (docs/evaluation.md).

Owns: the items and the task file. It never imports lm_eval or torch.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASK = "next_line"
MIN_CHARS = 20  # lines shorter than this (stage directions, "Exeunt.") make no item or candidate
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
# The same items as text (loglikelihood_rolling: bits per byte of each context line) and as
# generation (generate_until: greedy, 12 tokens at most, up to a blank line; exact match with the
# true next line).
TEXT_YAML = """task: {task}_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: context
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
metadata:
  version: 1.0
"""
GEN_YAML = """task: {task}_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\n"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


def next_line_items(text: str, n_items: int, n_choices: int = 4, seed: int = 0) -> list[dict]:
    """`n_items` items {context, choices, label}: a line, the line after it and n_choices - 1
    other distinct lines of `text` in a seeded random order, label = the true line's index."""
    lines = [line.strip() for line in text.splitlines()]
    pairs = [(a, b) for a, b in zip(lines, lines[1:]) if len(a) >= MIN_CHARS and len(b) >= MIN_CHARS]
    pool = sorted({line for line in lines if len(line) >= MIN_CHARS})
    if len(pairs) < n_items or len(pool) < n_choices + 1:
        raise ValueError(f"the text has {len(pairs)} pairs of consecutive lines of >= {MIN_CHARS} "
                         f"characters, fewer than the {n_items} items asked")
    rng = random.Random(seed)
    items = []
    for context, true in rng.sample(pairs, n_items):
        others = rng.sample([line for line in pool if line not in (context, true)], n_choices - 1)
        choices = [true, *others]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(true)})
    return items


def write_task(text: str, out: Path, n_items: int, seed: int = 0, task: str = TASK) -> Path:
    """out/TASK.jsonl, out/TASK.yaml (multiple choice), TASK_text.yaml and TASK_gen.yaml (their
    data path absolute); the first YAML's path."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{task}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in next_line_items(text, n_items, seed=seed)),
                    encoding="utf-8")
    for name, template in ((task, TASK_YAML), (f"{task}_text", TEXT_YAML), (f"{task}_gen", GEN_YAML)):
        (out / f"{name}.yaml").write_text(template.format(task=task, data=json.dumps(str(data.resolve()))),
                                          encoding="utf-8")
    return out / f"{task}.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpctrain.lm_eval_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="a UTF-8 text file (e.g. a play of data_tools' corpus)")
    p.add_argument("--output", required=True, help="folder for TASK.jsonl and TASK.yaml")
    p.add_argument("--items", type=int, default=200, help="items (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default=TASK, help=f"the task's name (default {TASK})")
    args = p.parse_args(argv)
    try:
        text = Path(args.text).read_text(encoding="utf-8")
        yaml = write_task(text, Path(args.output), args.items, args.seed, args.task)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"{args.text}: {e}") from None
    print(yaml)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
