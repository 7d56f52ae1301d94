"""The tokenizer files of a Hugging Face model folder, written from a run's tokenizer record.

Owns: turning the tokenizer a checkpoint records (its trainer state's "tokenizer": name, eot_id,
and for a tokenizer.json the carried file texts; see tokenizers.tokenizer_file_of) into files
with which ``transformers.AutoTokenizer.from_pretrained(DIR)`` gives, offline, the ids the shards
hold: a tokenizer.json (the dataset's, byte for byte; gpt2's built from its genuine vocab.json +
merges.txt, which go beside it) and a tokenizer_config.json that makes AutoTokenizer load that
file as it is (`tokenizer_config`), never a class that rebuilds its own pre-tokenizer from the
vocabulary (transformers 5's Qwen2Tokenizer splits digits one by one, GPT2Tokenizer takes
special-token text as the special id). For `hpctrain export --format hf` (``write_hf_tokenizer``).

A shard's document is its text's ids (no BOS; special-token text as plain text) followed by the
end-of-text id: ``AutoTokenizer(text)["input_ids"] + [eos_token_id]``.

Must never: download, import transformers, or write anything but these files into ``out_dir``.
"""
from __future__ import annotations

import json
import os
import shutil

from . import logs
from .format import DataError
from .tokenizers import ENDOFTEXT, dataset_tokenizer, gpt2_files

CONFIG = "tokenizer_config.json"
TOKENIZER = "tokenizer.json"
CHAT_TEMPLATE = "chat_template.jinja"  # transformers' separate chat template file, where the data had one
# model types whose registered tokenizer class transformers 5 loads whatever tokenizer_config.json
# names (qwen2; qwen2_moe shares the class), rebuilding Qwen2's pre-tokenizer from the vocabulary:
# an `auto_map` entry (naming LOADER, for trust_remote_code=True) is what makes it read the file
REBUILT_BY_MODEL_TYPE = ("qwen2", "qwen2_moe")
LOADER = "tokenization_hpctrain.py"
LOADER_CLASS = "tokenization_hpctrain.HpctrainTokenizer"
LOADER_CODE = '''"""Written by `hpctrain export`: tokenizer.json exactly as the training data was made with
(AutoTokenizer with trust_remote_code=True loads this class; without it, PreTrainedTokenizerFast)."""
from transformers import PreTrainedTokenizerFast


class HpctrainTokenizer(PreTrainedTokenizerFast):
    """tokenizer.json as it is: no pre-tokenizer rebuilt from the vocabulary and merges."""
'''
# keys of a dataset's tokenizer_config.json that would name another class (or code), or BOS/EOS
# rules of one: the exported file sets its own
REPLACED = ("tokenizer_class", "auto_map", "add_bos_token", "add_eos_token", "tokenizer_file",
            "name_or_path", "split_special_tokens", "model_max_length")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def gpt2_tokenizer_json() -> str:
    """GPT-2's BPE (the genuine vocab.json + merges.txt) as a tokenizer.json: byte-level with
    GPT-2's regex, <|endoftext|> the special id 50256 (tiktoken's ids, tested)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab_bpe, encoder_json = gpt2_files()
    tok = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(ENDOFTEXT, special=True)])
    return tok.to_str()


def _unk_token(spec: dict) -> str | None:
    model = spec.get("model") or {}
    if model.get("type") == "Unigram" and isinstance(model.get("unk_id"), int):
        return model["vocab"][model["unk_id"]][0]
    return model.get("unk_token")


def tokenizer_config(spec: dict, eos: str, carried: dict, max_length: int,
                     chat: bool = False) -> dict:
    """tokenizer_config.json for tokenizer.json `spec` (a dict) whose documents end with `eos`:
    the dataset's `carried` one (chat template, added tokens, bos) without the keys that name a
    class or BOS/EOS rules, and PreTrainedTokenizerFast (AutoTokenizer then loads tokenizer.json
    as it is), special-token text split as plain text (split_special_tokens: the sharder's rule;
    `chat`: a chat dataset's, whose template's special tokens are recognised, as `--format chat`),
    no BOS/EOS added by the class, eos = the shards' end-of-text token (pad and unk default to it
    and the model's unk)."""
    cfg = {k: v for k, v in carried.items() if k not in REPLACED}
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eos, split_special_tokens=not chat,
               add_bos_token=False, add_eos_token=False, model_max_length=max_length)
    cfg.setdefault("pad_token", eos)
    unk = _unk_token(spec)
    if unk is not None:
        cfg.setdefault("unk_token", unk)
    return cfg


def _post_processor_adds(text: str) -> list[str]:
    """The tokens tokenizer.json's post_processor adds to a text (Llama 3's <|begin_of_text|>)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    plain = tok.encode("a", add_special_tokens=False).tokens
    return [t for t in tok.encode("a", add_special_tokens=True).tokens if t not in plain]


def _dataset_files(info: dict, data_path: str) -> tuple[str, dict, str]:
    """(tokenizer.json text, its tokenizer_config.json as a dict or {}, the end-of-text token) of
    a tokenizer.json dataset, as the checkpoint carries them (else the dataset's copy, sha256)."""
    tok = dataset_tokenizer(info, data_path)
    text = (info.get("files") or {}).get(info.get("file", ""))
    if text is None:  # byte for byte what the data was made with
        with open(tok.path, encoding="utf-8") as f:
            text = f.read()
    try:
        carried = json.loads((info.get("files") or {}).get(CONFIG) or "{}")
    except ValueError:
        carried = {}
    return text, carried if isinstance(carried, dict) else {}, tok.tok.id_to_token(int(info["eot_id"]))


def _chat_template_file(info: dict, data_path: str) -> str | None:
    """The dataset's chat_template.jinja text: as the checkpoint carries it, else the dataset's
    copy (a checkpoint written before checkpoints carried it), else None."""
    carried = (info.get("files") or {}).get(CHAT_TEMPLATE)
    if carried is not None:
        return carried
    path = os.path.join(str(data_path), CHAT_TEMPLATE)
    if data_path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def write_hf_tokenizer(info: dict, data_path: str, out_dir: str, max_length: int = 1024,
                       model_type: str = "") -> list[str]:
    """Write the tokenizer files for ``info`` (a checkpoint's tokenizer record) into ``out_dir``
    for a model of config.json's ``model_type``; returns their names. ``bytes`` has no Hugging
    Face equivalent: DataError."""
    names = []
    if info.get("name") == "gpt2":
        vocab_bpe, encoder_json = gpt2_files()
        shutil.copyfile(encoder_json, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(vocab_bpe, os.path.join(out_dir, "merges.txt"))
        names = ["vocab.json", "merges.txt"]
        text, eos = gpt2_tokenizer_json(), ENDOFTEXT
        carried = {"bos_token": ENDOFTEXT, "unk_token": ENDOFTEXT, "add_prefix_space": False}
    elif "sha256" not in info:
        raise DataError(f"tokenizer {info.get('name')!r}", "has no Hugging Face tokenizer files (only "
                                                           "gpt2 and tokenizer.json datasets export "
                                                           "one); load the model without a tokenizer")
    else:
        text, carried, eos = _dataset_files(info, data_path)
    _write(os.path.join(out_dir, TOKENIZER), text)
    config = tokenizer_config(json.loads(text), eos, carried, max_length,
                              chat=info.get("format") == "chat")
    if model_type in REBUILT_BY_MODEL_TYPE:
        _write(os.path.join(out_dir, LOADER), LOADER_CODE)
        config["auto_map"] = {"AutoTokenizer": [LOADER_CLASS, LOADER_CLASS]}
        names.append(LOADER)
    _write(os.path.join(out_dir, CONFIG), json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    template = _chat_template_file(info, data_path)
    if template is not None:  # apply_chat_template reads it beside tokenizer_config.json
        _write(os.path.join(out_dir, CHAT_TEMPLATE), template)
        names.append(CHAT_TEMPLATE)
    added = _post_processor_adds(text)
    if added:
        logs.get_logger(__name__).warning(
            f"warning: the exported {TOKENIZER}'s post_processor adds {', '.join(added)} "
            f"to every text (AutoTokenizer's add_special_tokens=True), which the training shards "
            f"do not hold: encode with add_special_tokens=False for the ids the model was trained on")
    return [*names, TOKENIZER, CONFIG]
