"""`python -m hpctrain export --checkpoint DIR --format hf --output OUT`: a checkpoint as a Hugging
Face model folder (config.json + model.safetensors) that `AutoModelForCausalLM.from_pretrained`
loads, written by the family's Hugging Face adapter (its ModelSpec's HFSpec, hpctrain/model/<arch>/hf.py):
e.g. GPT2LMHeadModel for model.arch = "gpt2"; for "llama" LlamaForCausalLM, Qwen2ForCausalLM
(q/k/v bias), MixtralForCausalLM (experts) or Qwen2MoeForCausalLM (experts + a gated shared one).
Weights above --max-shard-size are sharded as transformers does (hpctrain/interop/hf_files.py), and
the run's dataset tokenizer goes with them (data_tools/tokenizer_files.py), so that
`AutoTokenizer.from_pretrained(OUT)` gives the ids the shards hold and
`pipeline("text-generation", OUT)` works offline. n_positions / max_position_embeddings is
model.max_positions (an init.from folder's, whatever block_size the run trained at).

The name and layout mappings are the families' (hpctrain/model/gpt2/hf.py, llama/hf.py, ...). It reads any
layout's checkpoint (DCP keys are layout-free: DDP, FSDP, TP, PP save the same FQNs) in one process
through the checkpoint manager (safe loading, no pickle), writes the folder's files into a staging
folder beside OUT (`.OUT.hpctrain-partial`) and moves them in only when all are written (a full
disk leaves OUT as it was and removes the staging folder), and must never import transformers (a
test-only dependency) or modify the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from hpctrain import export_lora, logs
from hpctrain.checkpoint import CheckpointManager, disk_format
from hpctrain.checkpoint.cli import resolve_checkpoint
from hpctrain.checkpoint.safe_load import read_metadata
from hpctrain.errors import UserError
from hpctrain.interop import hf_files
from hpctrain.model import spec as model_spec


find_checkpoint = resolve_checkpoint  # the name bench/recipe.py and the tests import


def load_model_state(ckpt: Path) -> tuple[dict, dict]:
    """(our model's tensors by FQN, the model config) from a committed checkpoint."""
    problems = disk_format.verify_checkpoint(ckpt)
    if problems:
        raise UserError(f"{ckpt}: not an intact checkpoint: {problems[0]}")
    trainer = disk_format.read_trainer_state(ckpt, use="export").get("trainer", {})
    model_cfg = trainer.get("config", {}).get("model")
    if not model_cfg:
        raise UserError(f"{ckpt / disk_format.TRAINER_STATE_FILE}: no config.model (not a checkpoint "
                        f"of `hpctrain train`); export a training run's checkpoint")
    md = read_metadata(ckpt / disk_format.DCP_METADATA_FILE)
    state = {"model": {}}
    for fqn, meta in md.state_dict_metadata.items():
        if fqn.startswith("model.") and hasattr(meta, "size"):
            state["model"][fqn[len("model."):]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if not state["model"]:
        raise UserError(f"{ckpt}: checkpoint holds no model.* tensors")
    CheckpointManager(ckpt.parent, keep=1, rank=0, world_size=1).load(ckpt, state)
    return state["model"], model_cfg


# The files an export writes; with --force they are replaced, nothing else in the folder is touched
EXPORT_FILES = ("config.json", "model*.safetensors", "tokenizer files")


def check_output(out: Path, force: bool) -> None:
    """Refuse a folder that holds anything (a user's files, another model) unless --force."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder; give --output a new or empty folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not force:
        more = f" (+{len(held) - 3} more)" if len(held) > 3 else ""
        raise UserError(f"{out}: not empty (holds {', '.join(held[:3])}{more}); export into a new "
                        f"or empty folder, or pass --force to replace its {', '.join(EXPORT_FILES)}")


def write_tokenizer(trainer: dict, out: Path, config: dict) -> list[str]:
    """The run's dataset tokenizer (as the checkpoint records it) as Hugging Face tokenizer files
    with which AutoTokenizer gives the shards' ids, for the model of `config` (config.json);
    none, with a one-line warning, for a tokenizer that has no Hugging Face form (bytes)."""
    from data_tools.format import DataError
    from data_tools.tokenizer_files import write_hf_tokenizer

    info = trainer.get("tokenizer") or {}
    data_path = str(((trainer.get("config") or {}).get("data") or {}).get("path", ""))
    positions = config.get("max_position_embeddings") or config["n_positions"]
    try:
        return write_hf_tokenizer(info, data_path, str(out), max_length=positions,
                                  model_type=config["model_type"])
    except DataError as e:
        logs.warning(f"warning: no tokenizer files exported: {e}")
        return []


STAGING_SUFFIX = ".hpctrain-partial"  # as data_tools/staging.py names its own


def write_folder(out: Path, files: dict, max_bytes: int, tokenizer) -> list[str]:
    """Write the export into `.OUT.hpctrain-partial` beside `out`, then move its files into `out`
    (replacing an earlier export's there, --force); returns the names written. On a failure (a
    full disk) the staging folder is removed, `out` is left as it was: one UserError naming it.
    `files`: {"weights": HF tensors, "config.json": dict}; `tokenizer(folder)` writes those files."""
    from safetensors import SafetensorError

    real = out.resolve()  # "." or a link: beside the folder itself (one file system)
    staging = real.parent / f".{real.name}{STAGING_SUFFIX}"
    shutil.rmtree(staging, ignore_errors=True)  # a killed export's
    try:
        staging.mkdir(parents=True)
        written = hf_files.save_weights(files["weights"], staging, max_bytes)
        (staging / "config.json").write_text(json.dumps(files["config.json"], indent=2) + "\n")
        written = ["config.json", *written, *tokenizer(staging)]
        _move_in(staging, real)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"{out}: cannot write the export ({reason}); nothing was written there: "
                        f"free space or choose another --output") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _move_in(staging: Path, out: Path) -> None:
    """The staged files into `out` (renames on one file system: no space needed); an earlier
    export's weight files there go first (its shards would outlive a single new file)."""
    if not out.exists():
        os.rename(staging, out)
        return
    for old in hf_files.old_weight_files(out):
        old.unlink()
    for staged in staging.iterdir():
        os.replace(staged, out / staged.name)
    staging.rmdir()


def export_hf(checkpoint: str | Path, output: str | Path, force: bool = False,
              max_shard_size: str | int = "5GB") -> Path:
    max_bytes = hf_files.parse_size(max_shard_size)
    out = Path(output)
    check_output(out, force)
    ckpt = resolve_checkpoint(checkpoint, use="export")
    sd, model_cfg = load_model_state(ckpt)
    spec = model_spec.of_section(model_cfg)
    if spec.hf is None:
        raise UserError(f"{ckpt}: model.arch {spec.name!r} has no Hugging Face export")
    trainer = disk_format.read_trainer_state(ckpt, use="export").get("trainer", {})
    if export_lora.lora_section(trainer):  # adapters only: merged into the rebuilt base
        sd = export_lora.merged_state(sd, trainer, model_cfg)
    tensors, config = spec.hf_module().export({k: v.float().contiguous() for k, v in sd.items()}, model_cfg)
    tok = trainer.get("tokenizer") or {}
    if isinstance(tok.get("eot_id"), int):
        config["bos_token_id"] = config["eos_token_id"] = tok["eot_id"]
    written = write_folder(out, {"weights": tensors, "config.json": config}, max_bytes,
                           lambda folder: write_tokenizer(trainer, folder, config))
    shown = written if len(written) <= 6 else [*written[:5], f"... ({len(written)} files)"]
    print(f"exported {ckpt} (step {json.loads((ckpt / disk_format.COMMIT_FILE).read_text())['step']}) "
          f"-> {out} (Hugging Face {config['architectures'][0]}: {', '.join(shown)})")
    return out


def export_peft(checkpoint: str | Path, output: str | Path, force: bool = False) -> Path:
    """A LoRA run's adapters as a PEFT adapter folder (hpctrain/export_lora.py)."""
    out = Path(output)
    check_output(out, force)
    ckpt = resolve_checkpoint(checkpoint, use="export")
    sd, model_cfg = load_model_state(ckpt)
    trainer = disk_format.read_trainer_state(ckpt, use="export").get("trainer", {})
    if not export_lora.lora_section(trainer):
        raise UserError(f"{ckpt}: not a LoRA run's checkpoint (lora.rank = 0); export --format hf")
    written = export_lora.write_peft(sd, trainer, model_cfg, out)
    print(f"exported {ckpt} LoRA adapters -> {out} (PEFT: {', '.join(written)})")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpctrain export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="step_N directory, checkpoint root or run directory (newest intact)")
    parser.add_argument("--format", default="hf", choices=["hf", "peft"],
                        help="hf: a Hugging Face folder: " + "; ".join(
                            model_spec.get(n).hf.export_words for n in model_spec.names()
                            if model_spec.get(n).hf) + " (a LoRA run: its adapters merged); peft: a "
                             "LoRA run's adapters as PEFT's adapter_config.json + adapter_model.safetensors")
    parser.add_argument("--output", required=True, help="output folder (new or empty)")
    parser.add_argument("--force", action="store_true",
                        help="export into a folder that is not empty: replace its config.json and "
                             "weights and tokenizer files (other files stay)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="above this size the weights are split into model-0000k-of-0000n."
                             "safetensors + model.safetensors.index.json, as transformers does "
                             "(default 5GB; units B, KB, MB, GB, KiB, MiB, GiB)")
    args = parser.parse_args(argv)
    if args.format == "peft":
        export_peft(args.checkpoint, args.output, args.force)
    else:
        export_hf(args.checkpoint, args.output, args.force, args.max_shard_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
