"""The weight files of an init.from folder, opened safely and checked against the model its
config.json describes, before a single value is read.

Owns: which files may be read (model.safetensors, or the files model.safetensors.index.json
names: plain relative names inside the folder, no '..', no absolute path, no link that resolves
outside it; a Hugging Face cache snapshot's links into its repository's blobs/ folder are fine),
reading their headers (a truncated or foreign file is one line naming it), the table of every
tensor's file, shape and dtype, and `check_tensors`: the folder holds exactly the tensors of the
[model] section (as `hpctrain export` writes them), each with its shape and a float dtype (fp32,
bf16, fp16); extra, missing, resized or integer tensors are refused, naming tensor and file. What
transformers saves beside the weights is accepted unread: a tied head's duplicate, rotary
inv_freq and GPT-2's attention-mask buffers. Never reads tensor data here (hf_import.py does).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hpctrain.errors import UserError
from hpctrain.interop import hf_files
from hpctrain.model import spec as model_spec

SINGLE, INDEX = hf_files.SINGLE, hf_files.INDEX
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# buffers some transformers versions save beside the weights: they hold no weights, never read
BUFFERS = re.compile(r"(.+\.)?(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)")
WHAT_TO_DO = "fix config.json or the weights (save_pretrained writes matching ones)"


@dataclass(frozen=True)
class TensorInfo:
    file: str                 # as the index names it (or model.safetensors)
    shape: tuple[int, ...]
    dtype: str                # safetensors' name: F32, BF16, I8, ...


class WeightFiles:
    """The folder's tensors by HF name: the header of every weight file read (and checked) at
    once, the files kept open for `slice` (safetensors maps them; nothing is read before)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        real = self.folder.resolve()
        # a Hugging Face cache snapshot (hub/models--X/snapshots/REV) links into ../../blobs
        self.roots = [real] + ([real.parent.parent / "blobs"] if real.parent.name == "snapshots" else [])
        self.tensors: dict[str, TensorInfo] = {}
        self.open_files: dict[str, object] = {}
        if (self.folder / INDEX).exists():
            self._read_index()
        elif (self.folder / SINGLE).exists():
            self._read_header(SINGLE)
        else:
            raise UserError(f"{self.folder}: no {SINGLE} or {INDEX} (init.from)")

    def _read_index(self) -> None:
        """Every file the index names (checked: `inside`), each tensor where the index says."""
        weight_map = read_index(self.inside(INDEX))
        first_entry: dict[str, str] = {}
        for name, file in weight_map.items():
            first_entry.setdefault(file, name)
        for file, entry in first_entry.items():
            self._read_header(file, entry)
        for name, file in weight_map.items():
            if self.tensors.get(name, TensorInfo("", (), "")).file != file:
                raise UserError(f"{self.folder / INDEX}: entry {name!r} names {file}, which holds "
                                f"no tensor {name!r}; {WHAT_TO_DO}")
        unlisted = next((n for n in self.tensors if n not in weight_map), None)
        if unlisted is not None:
            raise UserError(f"{self.folder / self.tensors[unlisted].file}: tensor {unlisted!r} is "
                            f"not in {INDEX}; {WHAT_TO_DO}")

    def inside(self, name, entry: str | None = None) -> Path:
        """folder/name, refused (naming the index entry that names it) unless a plain relative
        name inside the folder whose link, if it is one, resolves inside too."""
        where = f"{self.folder / INDEX}: entry {entry!r}" if entry else str(self.folder / str(name))
        rel = PurePosixPath(name) if isinstance(name, str) and name else None
        if rel is None or rel.is_absolute() or ".." in rel.parts:
            raise UserError(f"{where} names {json.dumps(name)}: weight files must be named relative "
                            f"to the folder, without '..' (init.from reads nothing outside it)")
        path = self.folder / rel
        real = path.resolve()
        if not any(real.is_relative_to(root) for root in self.roots):
            raise UserError(f"{where}: {path} is a link to {real}, outside {self.folder} (init.from "
                            f"reads nothing outside the folder); copy the file into it")
        if not real.is_file():
            raise UserError(f"{where} names {name}, which is missing from {self.folder} (an "
                            f"incomplete download or copy?)")
        return path

    def _read_header(self, file: str, entry: str | None = None) -> None:
        """Open one weight file (safetensors checks its header against its size) and add its
        tensors to the table."""
        from safetensors import SafetensorError, safe_open

        path = self.inside(file, entry)
        try:
            handle = safe_open(str(path), "pt")
            for name in handle.keys():
                part = handle.get_slice(name)
                self.tensors[name] = TensorInfo(file, tuple(part.get_shape()), part.get_dtype())
        except SafetensorError as e:
            raise UserError(f"{path}: not a readable safetensors file ({e}); download or save it "
                            f"again") from None
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
        self.open_files[file] = handle

    def hf_name(self, name: str) -> str:
        """The folder's name of HF tensor `name` (a GPT-2 saved from GPT2Model lacks the
        "transformer." prefix)."""
        short = name.removeprefix("transformer.")
        return short if name not in self.tensors and short in self.tensors else name

    def slice(self, name: str):
        """safetensors' lazy slice of HF tensor `name`."""
        name = self.hf_name(name)
        if name not in self.tensors:
            raise UserError(f"{self.folder}: tensor {name!r} not found (init.from)")
        return self.open_files[self.tensors[name].file].get_slice(name)

    def where(self, name: str) -> str:
        """"FILE: tensor 'NAME'" of HF tensor `name`, for messages."""
        info = self.tensors.get(self.hf_name(name))
        return f"{self.folder / info.file if info else self.folder}: tensor {self.hf_name(name)!r}"


def read_index(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map, checked: a JSON object of tensor name -> file."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{index}: cannot read it as JSON ({e}); download or save it again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: 'weight_map' is {json.dumps(weight_map)[:40]}, not a JSON object "
                        f"of tensor name -> file; download or save it again")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise UserError(f"{index}: entry {bad!r} names {json.dumps(weight_map[bad])[:40]}, not a "
                        f"file name; download or save it again")
    return weight_map


def expected_tensors(section: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a folder of this [model] section holds, as `hpctrain
    export` writes them: the model built on the meta device (no memory), mapped by its family's
    HF adapter (HFSpec.export: gpt2's c_attn joins q, k, v; MoE experts one tensor each)."""
    import torch

    from hpctrain.model import build_model_from_section

    with torch.device("meta"):
        model = build_model_from_section({**section, "dropout": 0.0})
    tensors, _ = model_spec.of_section(section).hf_module().export(model.state_dict(), section)
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _model_words(section: dict) -> str:
    return (f"the {model_spec.of_section(section).name} model config.json describes ({section['n_layer']} "
            f"layers, width {section['n_embd']}, vocabulary {section['vocab_size']})")


def _wanted_shape(name: str, expected: dict, section: dict) -> tuple[int, ...] | None:
    """The shape the folder's tensor `name` must have; None: not a tensor of this model."""
    if name in expected:
        return expected[name]
    alias = _alias(name, section)
    return expected.get(alias[0]) if alias else None


def _alias(name: str, section: dict) -> tuple[str, bool] | None:
    """(exported name, the same tensor) a folder's `name` stands for (HFSpec's alias)."""
    return model_spec.of_section(section).hf_module().alias(name, section)


def check_tensors(files: WeightFiles, section: dict) -> None:
    """UserError naming the first tensor of the folder that is not one of `section`'s model,
    has another shape or is not a float dtype, else the first tensor the model needs that the
    folder lacks."""
    expected = expected_tensors(section)
    found = set()
    for name, info in files.tensors.items():
        if BUFFERS.fullmatch(name):
            continue
        want = _wanted_shape(name, expected, section)
        if want is None:
            raise UserError(f"{files.where(name)} is not a weight of {_model_words(section)}; "
                            f"remove it or fix config.json")
        if info.dtype not in FLOAT_DTYPES:
            raise UserError(f"{files.where(name)} is {info.dtype}: init.from reads float32, "
                            f"bfloat16 or float16 weights (no quantized or integer ones); save it "
                            f"in one of those")
        if info.shape != want:
            raise UserError(f"{files.where(name)} has shape {info.shape}, {_model_words(section)} "
                            f"needs {want}; {WHAT_TO_DO}")
        alias = None if name in expected else _alias(name, section)
        found.update({name} | ({alias[0]} if alias and alias[1] else set()))
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{files.folder}: no tensor {missing[0]!r}{more} in its weight files, which "
                        f"{_model_words(section)} needs; {WHAT_TO_DO}")


def open_checked(folder: str | Path, section: dict) -> WeightFiles:
    """The folder's weight files, every header read and every tensor checked against `section`."""
    files = WeightFiles(folder)
    check_tensors(files, section)
    return files
