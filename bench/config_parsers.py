"""Config parsing (issue 18): ours (hpctrain.config) next to tyro and pydantic on the same real inputs.

Run:  python bench/config_parsers.py [--runs 9] [--parses 200]

tyro and pydantic are NOT project dependencies; install them in a throwaway place and put it on the
path, e.g.  python3 -m venv /tmp/cfg-venv && /tmp/cfg-venv/bin/pip install tyro pydantic  then
PYTHONPATH=/tmp/cfg-venv/lib/python3.11/site-packages .venv/bin/python bench/config_parsers.py
A library that does not import is reported and skipped.

Every approach builds the config from each configs/*.toml plus the same command-line overrides:
  ours      hpctrain.config.load (TOML -> coerce per key -> dataclasses; --section.key=value)
  tyro      tyro.cli(Config, default=<the TOML's values>, args=overrides) on our dataclasses
  pydantic  TypeAdapter(Config) on our dataclasses (extra='forbid'); overrides merged into the
            TOML dict (our parse_overrides), then validate_python
Each library is measured twice where it matters: "raw" (the least glue that builds a config at all:
what the library itself reports) and "glue" (the glue it takes to match our behaviour: one-line
ConfigErrors naming the key, the MOVED hints, our override spellings). All approaches end with our
cross-key rules (Config.validate, hpctrain/config_rules.py): no library replaces those.

Per approach it prints: start-up in a fresh interpreter (import of hpctrain.config, the library's
import on top of it, the first parse with the parity glue; medians of --runs subprocesses each, the
approaches interleaved), parse time (TOML + overrides -> validated Config, median of --parses in one
process), whether each real config equals ours field by field (value and type), the first line of
the error for each bad input and whether the whole error is one line naming the key, edge inputs on
which it disagrees with ours (accepts what we reject or the reverse), whether --help lists every
key with its help and choices, and the lines of our code replaced against the glue written here
(counted from the source: code lines, without docstrings, comments or blank lines).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpctrain import config as C  # noqa: E402
from hpctrain.errors import ConfigError  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# the single-node training configs (the llama3 ones plan GPU layouts that OVERRIDES' diloco and
# compile refuse, and demo_tune.toml holds a [tune] section that only `hpctrain tune` reads)
CONFIGS = [ROOT / "configs" / name for name in
           ("demo.toml", "recipe.toml", "shakespeare_gpt2.toml", "llama_tiny.toml", "llama_shakespeare.toml")]
# our override syntax, both spellings (--k=v and --k v), every value type and a Literal
OVERRIDES = ["--train.steps=400", "--train.warmup_steps=20", "--train.lr", "3e-4", "--train.precision=bf16", "--train.compile=true",
             "--checkpoint.keep=5", "--sync.mode=diloco", "--sync.inner_steps=8", "--sync.staleness", "3",
             "--data.cache_dir=off", "--dist.timeout_s=120", "--model.dropout=0.1"]


# ----------------------------------------------------------------------------------------------
# shared glue: the TOML half of our load() (both libraries need it; neither reads TOML itself)

def glue_read_toml(path):
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None


# ----------------------------------------------------------------------------------------------
# (b) tyro on our dataclasses

def tyro_raw_default(path):
    """Least glue: the TOML tables straight into our dataclasses as tyro's default (no type checks:
    tyro does not check defaults); required keys the TOML lacks become tyro.MISSING (CLI-required)."""
    import tyro

    raw = glue_read_toml(path)
    built = {}
    for name, cls in C.sections().items():
        values = dict(raw.get(name, {}))
        for f in dataclasses.fields(cls):
            if f.name not in values and f.default is C.REQUIRED and f.default_factory is C.REQUIRED:
                values[f.name] = tyro.MISSING
        built[name] = cls(**values)
    return C.Config(**built)


def tyro_raw_load(path, overrides):
    import tyro

    cfg = tyro.cli(C.Config, default=tyro_raw_default(path), args=overrides, prog="hpctrain train",
                   use_underscores=True, config=(tyro.conf.FlagConversionOff,))
    return C.validate(cfg)


def glue_tyro_default(path):
    """Parity: the TOML's values checked and converted per key (our coerce, ALIASES, MOVED) before
    they become tyro's default: from_dict again, less validate() and with MISSING for required."""
    import tyro

    raw, built = glue_read_toml(path), {}
    for name in raw:
        if name not in C.sections():
            raise ConfigError(f"unknown config section '{name}' in {path}")
    for name, cls in C.sections().items():
        hints, known, values = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}, {}
        for key, value in raw.get(name, {}).items():
            key = C.ALIASES.get(f"{name}.{key}", key)
            if key not in known:
                moved = C.MOVED.get(f"{name}.{key}")
                hint = f": it is now '{moved}'" if moved else ""
                raise ConfigError(f"unknown config key '{name}.{key}' in {path}{hint}")
            values[key] = C.coerce(f"{name}.{key}", value, hints[key])
        for key, f in known.items():
            if key not in values and f.default is C.REQUIRED and f.default_factory is C.REQUIRED:
                values[key] = tyro.MISSING
        built[name] = cls(**values)
    return C.Config(**built)


def glue_tyro_registry():
    """Parity: our bool spellings (--train.compile=true); tyro wants True/False or --train.no_compile."""
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def _bool(info):
        if info.type is not bool:
            return None
        return PrimitiveConstructorSpec(
            nargs=1, metavar="true|false", instance_from_str=lambda a: glue_tyro_bool(a[0]),
            is_instance=lambda x: isinstance(x, bool), str_from_instance=lambda x: [str(x).lower()])
    return registry


def glue_tyro_bool(text):
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def glue_tyro_hook(event):
    """Parity: tyro draws a multi-line box and exits 2; turn its (private, unstable: tyro._errors)
    parse-error events into our one-line ConfigError naming the key."""
    from tyro import _errors as E

    arg = getattr(event, "argument", None)
    key = arg.lowered.name_or_flags[0][2:] if arg is not None else "?"
    if isinstance(event, E.UnrecognizedArgs):
        raise ConfigError(f"unknown config key '{event.tokens[0][2:].split('=')[0]}' (command line)")
    if isinstance(event, E.InvalidChoice):
        raise ConfigError(f"config key '{key}': {event.value!r}: expected one of "
                          f"{', '.join(arg.lowered.choices)}")
    if isinstance(event, E.MissingArgs):
        names = [a.arg.lowered.name_or_flags[0][2:] for a in event.missing_arguments]
        raise ConfigError(f"missing required config key '{names[0]}'")
    if isinstance(event, (E.InstantiationFailure, E.BadValue)):
        raise ConfigError(f"config key '{key}': {getattr(event, 'message', 'bad value')}")


def glue_tyro_load(path, overrides):
    import tyro

    with tyro._errors.on_parse_error(glue_tyro_hook):
        cfg = tyro.cli(C.Config, default=glue_tyro_default(path), args=overrides, prog="hpctrain train",
                       use_underscores=True, registry=glue_tyro_registry(),
                       config=(tyro.conf.FlagConversionOff,))
    return C.validate(cfg)


def tyro_help():
    import tyro

    return tyro.cli(C.Config, default=glue_tyro_default(CONFIGS[0]), args=["--help"],
                    prog="hpctrain train", use_underscores=True, registry=glue_tyro_registry(),
                    config=(tyro.conf.FlagConversionOff,))


# ----------------------------------------------------------------------------------------------
# (c) pydantic on our dataclasses

_ADAPTER = None


def glue_pydantic_adapter():
    """Our stdlib dataclasses, unknown keys forbidden; built once per process (the schema build is
    part of the first parse's time)."""
    global _ADAPTER
    if _ADAPTER is None:
        from pydantic import ConfigDict, TypeAdapter

        for cls in (C.Config, *C.sections().values()):
            cls.__pydantic_config__ = ConfigDict(extra="forbid")
        _ADAPTER = TypeAdapter(C.Config)
    return _ADAPTER


def pydantic_raw_load(path, overrides):
    raw = glue_read_toml(path)
    for section, values in C.parse_overrides(overrides).items():
        raw.setdefault(section, {}).update(values)
    return C.validate(glue_pydantic_adapter().validate_python(raw))


def glue_pydantic_load(path, overrides):
    from pydantic import ValidationError

    raw = glue_read_toml(path)
    for section, values in C.parse_overrides(overrides).items():
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"config key '{section}': not a table")
        raw[section].update(values)
    for dotted, name in C.ALIASES.items():  # checkpoint.async -> async_save
        section, key = dotted.split(".")
        if key in raw.get(section, {}):
            raw[section][name] = raw[section].pop(key)
    if isinstance(raw.get("slurm", {}).get("requeue"), bool):  # `requeue = true`: a Literal of strings
        raw["slurm"]["requeue"] = str(raw["slurm"]["requeue"]).lower()
    try:
        cfg = glue_pydantic_adapter().validate_python(raw)
    except ValidationError as e:
        raise ConfigError(glue_pydantic_one_line(e, path)) from None
    return C.validate(cfg)


def glue_pydantic_one_line(e, source):
    """Parity: ValidationError's text is 4+ lines headed '1 validation error for Config'."""
    err = e.errors()[0]
    key = ".".join(str(part) for part in err["loc"])
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        moved = C.MOVED.get(key)
        hint = f": it is now '{moved}'" if moved else ""
        return f"unknown config key '{key}' in {source}{hint}"
    if err["type"] == "missing":
        return f"missing required config key '{key}' in {source}"
    return f"config key '{key}': {err['msg']}, got {err['input']!r}"


# ----------------------------------------------------------------------------------------------
# the approaches

@dataclasses.dataclass
class Approach:
    name: str
    module: str | None  # the library imported on top of hpctrain.config
    load: typing.Callable  # with parity glue
    raw_load: typing.Callable | None  # least glue (None: ours)
    replaces: tuple  # names in hpctrain/config.py this approach makes unnecessary
    keeps: tuple  # names in hpctrain/config.py it still needs
    glue: tuple  # functions in this file it needs


PARSER = ("sections", "coerce", "choices", "type_name", "from_dict", "parse_overrides", "load",
          "describe", "ALIASES", "MOVED")  # our parser: config.py less the declarations and to_toml
APPROACHES = {
    "ours": Approach("ours", None, C.load, None, (), PARSER, ()),
    "tyro": Approach("tyro", "tyro", glue_tyro_load, tyro_raw_load,
                     replaces=("from_dict", "parse_overrides", "load", "describe"),
                     keeps=("sections", "coerce", "choices", "type_name", "ALIASES", "MOVED"),
                     glue=(glue_read_toml, glue_tyro_default, glue_tyro_registry, glue_tyro_bool,
                           glue_tyro_hook, glue_tyro_load)),
    "pydantic": Approach("pydantic", "pydantic", glue_pydantic_load, pydantic_raw_load,
                         replaces=("coerce", "from_dict", "load"),
                         keeps=("sections", "choices", "type_name", "parse_overrides", "describe",
                                "ALIASES", "MOVED"),
                         glue=(glue_read_toml, glue_pydantic_adapter, glue_pydantic_load,
                               glue_pydantic_one_line)),
}


def available(a: Approach) -> str | None:
    """None if usable, else why not."""
    try:
        if a.module:
            __import__(a.module)
    except ImportError as e:
        return f"not importable ({e})"
    return None


def version(a: Approach) -> str:
    if a.module is None:
        return "-"
    from importlib.metadata import version as v

    return v(a.module)


# ----------------------------------------------------------------------------------------------
# measurements

CHILD = """
import sys, time
t0, n0 = time.perf_counter(), len(sys.modules)
sys.path.insert(0, {root!r})
import hpctrain.config
t1, n1 = time.perf_counter(), len(sys.modules)
if {module!r}:
    __import__({module!r})
t2, n2 = time.perf_counter(), len(sys.modules)
sys.path.insert(0, {bench!r})
import config_parsers as B
n3, t3 = len(sys.modules), time.perf_counter()
B.APPROACHES[{name!r}].load({path!r}, B.OVERRIDES)
t4 = time.perf_counter()
print(B.json.dumps({{"config_s": t1 - t0, "config_modules": n1 - n0, "lib_s": t2 - t1, "lib_modules": n2 - n1,
                    "first_parse_s": t4 - t3, "first_parse_modules": len(sys.modules) - n3}}))
"""


def startup(names: list[str], runs: int) -> dict:
    """Fresh interpreters, the approaches interleaved (a busy machine slows them alike); medians."""
    rows: dict = {name: [] for name in names}
    for _ in range(runs):
        for name in names:
            code = CHILD.format(root=str(ROOT), bench=str(ROOT / "bench"), name=name, path=str(CONFIGS[0]),
                                module=APPROACHES[name].module or "")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               cwd=ROOT)
            if r.returncode:
                raise RuntimeError(r.stderr[-2000:])
            rows[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}


def parse_time(a: Approach, n: int) -> float:
    a.load(CONFIGS[0], OVERRIDES)  # warm: imports and one-time builds are start-up, measured above
    times = []
    for i in range(n):
        path = CONFIGS[i % len(CONFIGS)]
        t = time.perf_counter()
        a.load(path, OVERRIDES)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def diff(ours, theirs) -> list[str]:
    """Fields whose value or type differ."""
    out = []
    for section, values in dataclasses.asdict(ours).items():
        other = dataclasses.asdict(theirs)[section]
        for key, value in values.items():
            if value != other[key] or type(value) is not type(other[key]):
                out.append(f"{section}.{key}: {value!r} vs {other[key]!r}")
    return out


def equality(load) -> str:
    bad, fields = [], 0
    for path in CONFIGS:
        ours = C.load(path, OVERRIDES)
        fields += sum(len(v) for v in dataclasses.asdict(ours).values())
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                bad += [f"{path.name}: {x}" for x in diff(ours, load(path, OVERRIDES))]
        except BaseException as e:  # noqa: BLE001 - SystemExit from a CLI library included
            text = [x.strip(" -│") for x in (err.getvalue() or str(e)).splitlines()
                    if x.strip(" -│╭╮╰╯─")]
            bad.append(f"{path.name}: {type(e).__name__}: {' '.join(text[1:3] or text)}")
    return (f"yes ({len(CONFIGS)} configs, {fields} fields)" if not bad
            else f"NO: {len(bad)} of {len(CONFIGS)} configs: " + "; ".join(bad[:1]))


DEMO_TOML = CONFIGS[0].read_text() if CONFIGS else ""
# (label, TOML text or None for configs/demo.toml, overrides, the key the error must name)
BAD = [
    ("unknown key in TOML (`[train] lr_max = 1`)", DEMO_TOML.replace("[train]\n", "[train]\nlr_max = 1\n"),
     [], "train.lr_max"),
    ("typo'd override (`--train.lrr=1`)", None, ["--train.lrr=1"], "train.lrr"),
    ("wrong type in TOML (`train.steps = \"ten\"`)", re.sub(r"(?m)^steps = \d+", 'steps = "ten"', DEMO_TOML),
     [], "train.steps"),
    ("outside the Literal (`--sync.mode=async`)", None, ["--sync.mode=async"], "sync.mode"),
    ("negative, rejected by our rules (`--data.prefetch=-1`)", None, ["--data.prefetch=-1"],
     "data.prefetch"),
    ("renamed key (MOVED: `[dist] grad_sync = \"mpi\"`)", DEMO_TOML + '\n[dist]\ngrad_sync = "mpi"\n', [],
     "dist.grad_allreduce"),
]
# edge inputs: does the approach accept what ours accepts and reject what ours rejects?
EDGE = [
    ("`--train.compile=on`", None, ["--train.compile=on"]),
    ("`--train.compile=1`", None, ["--train.compile=1"]),
    ("`--sync.staleness -1` (negative, space-separated)", None, ["--sync.staleness", "-1"]),
    ("`steps = 1800.0` in TOML", DEMO_TOML.replace("steps = 1800", "steps = 1800.0"), []),
    ("`[slurm] requeue = true` in TOML", DEMO_TOML + "\n[slurm]\nrequeue = true\n", []),
    ("`[checkpoint] async = true` in TOML", DEMO_TOML.replace("keep = 2", "keep = 2\nasync = true"), []),
]


def accepts(load, path, overrides) -> bool:
    return error_of(load, path, overrides) == "(accepted: no error)"


def error_of(load, path, overrides) -> str:
    """What the user sees: the exception's text, or what a CLI library printed before exiting."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            load(path, overrides)
    except SystemExit as e:
        return err.getvalue() or f"(exit {e.code}, nothing printed)"
    except Exception as e:  # noqa: BLE001
        prefix = "" if isinstance(e, ConfigError) else f"{type(e).__name__}: "
        return prefix + str(e)
    return "(accepted: no error)"


def judge(text: str, key: str) -> tuple[str, bool, int]:
    """The first line (stripped), whether the whole error is one line naming the key, its lines."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    for prefix in (str(ROOT) + "/", tempfile.gettempdir() + "/"):
        text = text.replace(prefix, "")
    text = re.sub(r"tmp\w+/", "", text)
    lines = [x for x in text.splitlines() if x.strip()]
    first = re.sub("─{3,}", "─", lines[0]).strip("╭╮─ ") if lines else ""
    return first, len(lines) == 1 and key in text, len(lines)


def help_check(text: str, sep: str) -> str:
    """Every key's flag, its help text and, for Literal keys, its choices joined by sep."""
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())
    keys = helps = lits = n_lit = 0
    for section, cls in C.sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys += f"--{section}.{f.name}" in flat
            helps += " ".join(f.metadata.get("help", "").split()) in flat
            choices = C.choices(hints[f.name])
            n_lit += bool(choices)
            lits += bool(choices) and sep.join(choices) in flat
    total = sum(len(dataclasses.fields(c)) for c in C.sections().values())
    return f"flags {keys}/{total}, help text {helps}/{total}, choices {lits}/{n_lit}"


def code_lines(obj) -> int:
    """Code lines of a function (less docstring, comments, blank lines) or of a module-level name."""
    if isinstance(obj, str):  # our parser: config.py and the coercion it takes from config_schema.py
        for text in (Path(C.__file__).read_text(), Path(C.__file__).with_name("config_schema.py").read_text()):
            for node in ast.parse(text).body:
                if isinstance(node, (ast.FunctionDef, ast.Assign)) and (
                        getattr(node, "name", None) == obj
                        or any(getattr(t, "id", None) == obj for t in getattr(node, "targets", []))):
                    return _count(textwrap.dedent(ast.get_source_segment(text, node)))
        raise KeyError(obj)
    return _count(textwrap.dedent(inspect.getsource(obj)))


def _count(src: str) -> int:
    node = ast.parse(src).body[0]
    skip = set()
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if i not in skip and line.strip() and not line.strip().startswith("#"))


def table(rows: list[tuple[str, str]]) -> str:
    out = ["| | |", "|---|---|"]
    out += [f"| {a} | {b.replace('|', '&#124;')} |" for a, b in rows]
    return "\n".join(out)


def write_inputs(tmp: str) -> tuple[list, list]:
    """BAD and EDGE as (label, config path, overrides, key / whether ours accepts it), their TOML
    texts written into ``tmp`` (the first config where an entry has none)."""
    bad = []
    for i, (label, text, overrides, key) in enumerate(BAD):
        path = CONFIGS[0]
        if text is not None:
            path = Path(tmp) / f"bad{i}.toml"
            path.write_text(text)
        bad.append((label, path, overrides, key))
    edge = []
    for i, (label, text, overrides) in enumerate(EDGE):
        path = CONFIGS[0]
        if text is not None:
            path = Path(tmp) / f"edge{i}.toml"
            path.write_text(text)
        edge.append((label, path, overrides, accepts(C.load, path, overrides)))
    return bad, edge


def startup_rows(a, s: dict, base: dict) -> list[tuple[str, str]]:
    """Import and first-parse costs of approach ``a`` (``base``: ours', the reference)."""
    rows = [("start-up: import hpctrain.config (incl. numpy via data_tools)",
             f"{s['config_s'] * 1e3:.0f} ms, {s['config_modules']:.0f} modules")]
    if a.module:
        rows.append((f"start-up: import {a.module} on top",
                     f"{s['lib_s'] * 1e3:.0f} ms, {s['lib_modules']:.0f} modules"))
    rows.append(("start-up: first parse (demo.toml + overrides, one-time builds)",
                 f"{s['first_parse_s'] * 1e3:.1f} ms, {s['first_parse_modules']:.0f} more modules"))
    if a.module and base:
        added = s["lib_s"] + s["first_parse_s"] - base["first_parse_s"]
        modules = s["lib_modules"] + s["first_parse_modules"] - base["first_parse_modules"]
        rows.append(("start-up added per rank vs ours (import + first parse)",
                     f"+{added * 1e3:.0f} ms, +{modules:.0f} modules"))
    return rows


def judgement_rows(a, variants, bad, edge) -> list[tuple[str, str]]:
    """Field-by-field equality with ours, each bad input's first error line, disagreements on
    the edge inputs."""
    rows = [(f"equals ours field by field{tag}", equality(load)) for tag, load in variants]
    for label, path, overrides, key in bad:
        for tag, load in variants:
            first, ok, n = judge(error_of(load, path, overrides), key)
            more = "" if n == 1 else f" ({n} lines)"
            rows.append((f"{label}{tag}", f"{'✓' if ok else '✗'} `{first}`{more}"))
    for tag, load in variants if a.module else ():
        disagree = [f"{label} {'accepted' if ok else 'rejected'}, ours {'rejects' if ok else 'accepts'}"
                    for label, path, overrides, ours_ok in edge
                    if (ok := accepts(load, path, overrides)) != ours_ok]
        rows.append((f"edge inputs where it disagrees with ours{tag}", "; ".join(disagree) or "none"))
    return rows


def help_row(a) -> tuple[str, str]:
    """Whether the approach's --help shows every key, its help text and its choices."""
    if a.name == "ours":
        return ("--help: every key, help text, choices", help_check(C.describe(), "|"))
    if a.name == "tyro":
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            os.environ["COLUMNS"] = "100"
            tyro_help()
        return ("--help: every key, help text, choices", help_check(out.getvalue(), ","))
    return ("--help: every key, help text, choices", "none of its own (no CLI): our describe() stays")


def lines_row(a, ours_lines: int) -> tuple[str, str]:
    """Our parser's code lines the approach replaces / keeps / needs as glue (ours: its own)."""
    if not a.module:
        return ("our parser lines (config.py less declarations, to_toml)",
                f"{ours_lines}: " + ", ".join(f"{n} {code_lines(n)}" for n in PARSER))
    repl = sum(code_lines(n) for n in a.replaces)
    keep = sum(code_lines(n) for n in a.keeps)
    glue = sum(code_lines(f) for f in a.glue)
    return ("our parser lines replaced / kept / glue written here",
            f"{repl} / {keep} / {glue} (net {glue - repl:+d}); replaces "
            f"{', '.join(a.replaces)}; glue: "
            + ", ".join(f"{f.__name__} {code_lines(f)}" for f in a.glue))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=9, help="fresh interpreters per approach (start-up)")
    p.add_argument("--parses", type=int, default=200, help="parses per approach (parse time)")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; inputs: "
          f"{', '.join('configs/' + c.name for c in CONFIGS)} + {' '.join(OVERRIDES)}\n")
    ours_lines = sum(code_lines(n) for n in PARSER)
    base: dict = {}  # ours' start-up, the reference
    with tempfile.TemporaryDirectory() as tmp:
        bad, edge = write_inputs(tmp)
        usable = [a.name for a in APPROACHES.values() if available(a) is None]
        starts = startup(usable, args.runs)
        for a in APPROACHES.values():
            print(f"## {a.name}" + (f" {version(a)}" if a.name in usable and a.module else ""))
            if a.name not in usable:
                print(f"skipped: {a.module} {available(a)}\n")
                continue
            rows = startup_rows(a, starts[a.name], base)
            if not a.module:
                base = starts[a.name]
            rows.append(("parse time, warm (median)", f"{parse_time(a, args.parses) * 1e3:.3f} ms"))
            variants = [("", a.load)] if a.raw_load is None else [(" raw", a.raw_load), (" +glue", a.load)]
            rows += judgement_rows(a, variants, bad, edge)
            if a.name == "ours":
                rows.append(("edge inputs accepted", "; ".join(f"{label} {'yes' if ok else 'no'}"
                                                             for label, _, _, ok in edge)))
            rows.append(help_row(a))
            rows.append(lines_row(a, ours_lines))
            print(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
