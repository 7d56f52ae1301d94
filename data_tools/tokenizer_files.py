"""The tokenizer files of a Hugging Face model folder, written from a run's tokenizer record.

Owns: turning the tokenizer a checkpoint records (its trainer state's "tokenizer": name, eot_id,
and for a tokenizer.json the carried file texts; see tokenizers.tokenizer_file_of) into files
``transformers.AutoTokenizer.from_pretrained(DIR)`` loads offline: gpt2 -> vocab.json +
merges.txt (the genuine files, sha256-checked) + tokenizer_config.json; a tokenizer.json -> it
and its tokenizer_config.json (one with eos_token is written when the dataset had none).
For `hpctrain export --format hf` (the exporter calls ``write_hf_tokenizer``).

Must never: download, or write anything but these files into ``out_dir``.
"""
from __future__ import annotations

import json
import os
import shutil

from .format import DataError
from .tokenizers import ENDOFTEXT, dataset_tokenizer, gpt2_files

CONFIG = "tokenizer_config.json"


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_hf_tokenizer(info: dict, data_path: str, out_dir: str, max_length: int = 1024) -> list[str]:
    """Write the tokenizer files for ``info`` (a checkpoint's tokenizer record) into
    ``out_dir``; returns their names. ``bytes`` has no Hugging Face equivalent: DataError."""
    name = info.get("name")
    if name == "gpt2":
        vocab_bpe, encoder_json = gpt2_files()
        shutil.copyfile(encoder_json, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(vocab_bpe, os.path.join(out_dir, "merges.txt"))
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT,
                  "unk_token": ENDOFTEXT, "model_max_length": max_length, "add_prefix_space": False}
        _write(os.path.join(out_dir, CONFIG), json.dumps(config, indent=2) + "\n")
        return ["vocab.json", "merges.txt", CONFIG]
    if "sha256" not in info:
        raise DataError(f"tokenizer {name!r}", "has no Hugging Face tokenizer files (only gpt2 and "
                                               "tokenizer.json datasets export one); load the "
                                               "model without a tokenizer")
    tok = dataset_tokenizer(info, data_path)  # the carried text, else the dataset's copy (sha256)
    carried_json = (info.get("files") or {}).get(info.get("file", ""))
    if carried_json is not None:  # byte for byte what the data was made with
        _write(os.path.join(out_dir, "tokenizer.json"), carried_json)
    else:
        shutil.copyfile(tok.path, os.path.join(out_dir, "tokenizer.json"))
    carried = (info.get("files") or {}).get(CONFIG)
    if carried is None:
        eos = tok.tok.id_to_token(int(info["eot_id"]))
        carried = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                              "model_max_length": max_length}, indent=2) + "\n"
    _write(os.path.join(out_dir, CONFIG), carried)
    return ["tokenizer.json", CONFIG]
