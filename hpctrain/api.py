"""`hpctrain.load(path)`: a trained model for Python code, with its tokenizer, its logits and text
generation (greedy, temperature, top-k, top-p, repetition penalty; as transformers decodes).

    import hpctrain
    lm = hpctrain.load("runs/demo")              # newest intact checkpoint; step=N for another
    lm.generate("ROMEO:", max_new_tokens=50, temperature=0.8, top_k=50, seed=0)  # -> text
    lm.logits(lm.encode("ROMEO:"))               # [T, vocab] (a [B, T] batch: [B, T, vocab])

Owns: what a path means here (a run directory or checkpoint root: its newest committed and intact
checkpoint, or `step`; one checkpoint's step_N folder; a Hugging Face model folder as `init.from`
reads it: GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE), building the model from the [model]
section its checkpoint records (or its config.json) on the meta device and loading the weights
the safe way only: a checkpoint through the checkpoint manager (restricted unpickler for DCP
metadata, weights_only tensors, every file against its checksum), a Hugging Face folder through
init.from's checked safetensors reader (hpctrain/interop/hf_weights.py; never pickle, never a
download). The tokenizer is the one the run trained with, as the checkpoint records it
(data_tools.tokenizers.dataset_tokenizer), or the folder's tokenizer.json / genuine GPT-2 files.
Decoding itself is hpctrain/model/sampling.py's. `hpctrain sample` is this API plus printing.
A bad path or argument is one UserError naming it. Single process: no MPI, no process group.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hpctrain.errors import UserError

WHAT_LOADS = ("hpctrain.load takes a run directory, a checkpoint root or step_N folder, or a "
              "Hugging Face model folder (config.json + model.safetensors)")


class LoadedModel:
    """A model in eval mode on `device` (`.model`, a torch nn.Module), the tokenizer it was trained
    with (`.tokenizer`: encode / decode, `.eot_id`; None when none is known: ids only), where it
    came from (`.path`, `.step`: None for a Hugging Face folder) and its end-of-sequence ids."""

    def __init__(self, model, tokenizer, path: Path, step: int | None, eos_ids: tuple[int, ...]):
        self.model, self.tokenizer, self.path, self.step = model, tokenizer, path, step
        self.eos_ids = eos_ids
        self.device = next(model.parameters()).device
        self.block_size, self.vocab_size = model.cfg.block_size, model.cfg.vocab_size

    def __repr__(self) -> str:
        step = f" step {self.step}" if self.step is not None else ""
        return (f"<LoadedModel {type(self.model).__name__} from {self.path}{step} on {self.device}, "
                f"tokenizer {getattr(self.tokenizer, 'name', None)}>")

    # ---- tokens ------------------------------------------------------------------------------
    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise UserError(f"{self.path}: no tokenizer recorded with this model: {what} takes "
                            f"token ids here")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, as training made them (no begin/end tokens added)."""
        return [int(i) for i in self._need_tokenizer("encode").encode(text)]

    def decode(self, ids) -> str:
        return self._need_tokenizer("decode").decode([int(i) for i in _as_tensor(ids).flatten()])

    def _batch(self, ids) -> tuple[torch.Tensor, bool]:
        """([B, T] long tensor on the model's device, whether `ids` was one sequence)."""
        t = _as_tensor(ids)
        if t.dim() not in (1, 2) or t.numel() == 0 or t.dtype.is_floating_point:
            raise UserError(f"ids: expected token ids as a non-empty [T] or [B, T] integer sequence, "
                            f"got shape {tuple(t.shape)} of {t.dtype}")
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= self.vocab_size:
            raise UserError(f"ids: token id {low if low < 0 else high} is outside the model's "
                            f"vocabulary 0..{self.vocab_size - 1}")
        return (t[None] if t.dim() == 1 else t).to(self.device, torch.long), t.dim() == 1

    # ---- the model ---------------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, ids) -> torch.Tensor:
        """The next-token logits (fp32) at every position of `ids`: [T, vocab] for one sequence
        (a list, a 1-D tensor), [B, T, vocab] for a batch; at most block_size positions."""
        batch, single = self._batch(ids)
        if batch.shape[1] > self.block_size:
            raise UserError(f"ids: {batch.shape[1]} tokens, more than the model's block_size "
                            f"{self.block_size}; pass the last {self.block_size}")
        out = self.model(batch).float()
        return out[0] if single else out

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop_at_eos: bool = True):
        """Continue `prompt`: text (returns text: the prompt and its continuation, without the
        final end-of-sequence token), token ids (a list or 1-D tensor: returns the list of ids,
        prompt first) or a [B, T] batch (returns [B, T + n], a finished row padded with eos).
        temperature 0 = greedy; top_k (None / 0 = all), top_p (1.0 = all) and repetition_penalty
        (1.0 = off) as transformers applies them; `seed` makes sampling reproducible (None: torch's
        global generator); `stop_at_eos`: a row ends at the model's end-of-sequence token."""
        from hpctrain.model.sampling import check_sampling, generate

        problem = check_sampling(temperature, top_k, top_p, repetition_penalty)
        if problem is None and (not isinstance(max_new_tokens, int) or max_new_tokens < 0):
            problem = f"max_new_tokens {max_new_tokens}: must be an integer >= 0"
        if problem is not None:
            raise UserError(f"generate: {problem}")
        ids = self._prompt_ids(prompt) if isinstance(prompt, str) else prompt
        batch, single = self._batch(ids)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(seed))
        eos = self.eos_ids if stop_at_eos else ()
        out = generate(self.model, batch, max_new_tokens, self.block_size, temperature, top_k or None,
                       top_p, repetition_penalty, gen, eos)
        if not isinstance(prompt, str):
            return out[0].tolist() if single else out
        new = out[0, batch.shape[1]:].tolist()
        while new and eos and new[-1] in eos:
            new.pop()
        return self.decode(out[0, :batch.shape[1]].tolist() + new)

    def _prompt_ids(self, text: str) -> list[int]:
        ids = self.encode(text)
        if ids:
            return ids
        start = self.eos_ids[:1] or ((self.tokenizer.eot_id,) if self.tokenizer is not None else ())
        if not start:
            raise UserError(f"{self.path}: an empty prompt needs an end-of-text token to start from")
        return list(start)


def _as_tensor(ids) -> torch.Tensor:
    return ids.detach() if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)


def load(path, device=None, step: int | None = None) -> LoadedModel:
    """The model at `path` (a run directory: its newest committed and intact checkpoint, or the
    one of `step`; a step_N folder; a Hugging Face model folder) in eval mode on `device` (default:
    CUDA when available, else the CPU), with its tokenizer. One UserError naming what is wrong."""
    return load_as(path, device, step, use="load")


def load_as(path, device=None, step: int | None = None, use: str = "load") -> LoadedModel:
    """`load`, for a command: `use` (load, sample) picks the words of a damaged checkpoint's error."""
    p, device = Path(path), resolve_device(device)
    if use == "load":
        _check_path(p)
    if _is_hf_folder(p):
        if step is not None:
            raise UserError(f"{p}: a Hugging Face model folder has no steps; step={step} is for a "
                            f"run directory")
        loaded = _from_hf(p)
    else:
        loaded = _from_checkpoint(_checkpoint_of(p, step, use), use)
    loaded.model.to(device)
    loaded.device = device
    return loaded


def resolve_device(device) -> torch.device:
    """`device` as a torch.device (None: CUDA when available, else the CPU); a UserError naming it
    when it is no device name or its kind is not here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"device {device!r}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r}: CUDA is not available here; use cpu")
    return found


def _check_path(p: Path) -> None:
    from hpctrain.checkpoint.cli import is_checkpoint_dir, resolve_root
    from hpctrain.checkpoint.directory import scan

    if not p.exists():
        raise UserError(f"{p}: no such file or directory; {WHAT_LOADS}")
    if not p.is_dir():
        raise UserError(f"{p}: not a directory; {WHAT_LOADS}")
    if not (_is_hf_folder(p) or is_checkpoint_dir(p) or scan(resolve_root(p))):
        raise UserError(f"{p}: holds no checkpoint and no config.json; {WHAT_LOADS}")


def _is_hf_folder(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and not (p / "COMMIT.json").exists()


def _checkpoint_of(p: Path, step: int | None, use: str) -> Path:
    """The checkpoint folder `p` (and `step`) names."""
    from hpctrain.checkpoint.cli import is_checkpoint_dir, resolve_checkpoint, resolve_root
    from hpctrain.checkpoint.directory import scan

    if step is None:
        return resolve_checkpoint(p, use=use)
    root = p.parent if is_checkpoint_dir(p) else resolve_root(p)
    found = [(s, path) for s, kind, path in scan(root) if kind == "checkpoint"]
    for s, path in found:
        if s == step:
            return path
    have = ", ".join(str(s) for s, _ in found[:8]) or "none"
    raise UserError(f"{root}: no checkpoint of step {step} (steps there: {have})")


def _build(section: dict) -> torch.nn.Module:
    """The model of a [model] section on the CPU, its parameters allocated and not initialized
    (every one is loaded next; built on the meta device: no time, no random numbers drawn)."""
    from hpctrain.model import build_model_from_section
    from hpctrain.parallel.meta_init import allocate

    with torch.device("meta"):
        model = build_model_from_section(section)
    allocate(model, torch.device("cpu"))
    return model.eval()


def _from_checkpoint(ckpt: Path, use: str) -> LoadedModel:
    from hpctrain import export_lora
    from hpctrain.checkpoint import CheckpointManager, disk_format

    saved = disk_format.read_trainer_state(ckpt, use=use).get("trainer") or {}
    config = saved.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) or not config["model"]:
        raise UserError(f"{ckpt / disk_format.TRAINER_STATE_FILE}: no config.model (not a checkpoint "
                        f"of `hpctrain train`); {use} a training run's checkpoint")
    model = _build(config["model"])
    if export_lora.lora_section(saved):  # LoRA: adapters only, merged into the rebuilt base
        from hpctrain.export import load_model_state

        model.load_state_dict(export_lora.merged_state(load_model_state(ckpt)[0], saved, config["model"]))
    else:
        state = {"model": model.state_dict()}
        CheckpointManager(ckpt.parent, keep=1, rank=0, world_size=1).load(ckpt, state)  # the model only
        model.load_state_dict(state["model"])
    info = saved.get("tokenizer") if isinstance(saved.get("tokenizer"), dict) else {}
    tokenizer = None
    if info.get("name"):
        from data_tools.tokenizers import dataset_tokenizer

        tokenizer = dataset_tokenizer(info, str((config.get("data") or {}).get("path", "")))
    eot = info.get("eot_id")
    return LoadedModel(model, tokenizer, ckpt, int(saved.get("step", 0)),
                       (eot,) if isinstance(eot, int) else ())


def _from_hf(folder: Path) -> LoadedModel:
    """A Hugging Face model folder, read as init.from reads it (config.json checked, every tensor
    checked against it before one value is read)."""
    import dataclasses

    from hpctrain.config_schema import ModelConfig
    from hpctrain.errors import ConfigError
    from hpctrain.interop.hf_import import load_weights, model_section
    from hpctrain.interop.hf_weights import open_checked

    try:
        section = dataclasses.asdict(ModelConfig(**model_section(folder)))
    except ConfigError as e:  # init.from's words: here nothing is a config key
        raise UserError(str(e).removeprefix("config key 'init.from': ")) from None
    files = open_checked(folder, section)
    model = _build(section)
    load_weights(model, files, section)
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    eos_ids = tuple(i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
    return LoadedModel(model.eval(), _hf_tokenizer(folder, eos_ids), folder, None, eos_ids)


def _hf_tokenizer(folder: Path, eos_ids: tuple[int, ...]):
    """The folder's tokenizer.json (its end-of-text: tokenizer_config.json's eos_token, else
    config.json's eos_token_id), or the genuine GPT-2 vocab.json + merges.txt; None otherwise."""
    import hashlib

    from data_tools.format import DataError
    from data_tools.tokenizers import (GPT2_ENCODER_JSON_SHA256, GPT2_VOCAB_BPE_SHA256,
                                       FileTokenizer, GPT2Tokenizer)
    from hpctrain import logs

    if (folder / "tokenizer.json").is_file():
        try:
            return FileTokenizer(str(folder / "tokenizer.json"))
        except DataError:
            if not eos_ids:
                raise
            return FileTokenizer(str(folder / "tokenizer.json"), eot_id=eos_ids[0])
    files = (folder / "merges.txt", folder / "vocab.json")
    if all(f.is_file() for f in files):
        sums = tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)
        if sums == (GPT2_VOCAB_BPE_SHA256, GPT2_ENCODER_JSON_SHA256):
            return GPT2Tokenizer()
        logs.warning(f"warning: {folder}: vocab.json + merges.txt are not GPT-2's; no tokenizer "
                     f"(token ids only)")
    return None
