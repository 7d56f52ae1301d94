"""`shard --format chat`: ids equal to transformers' apply_chat_template, the loss mask equal to
transformers' assistant mask, the reader's loss_mask aligned with its batch, one-line errors."""
import json
import os

import numpy as np
import pytest

from data_tools.format import DataError, open_shard_layout, read_manifest, shards_of
from data_tools.shard import shard_dataset
from data_tools.verify import verify_dataset
from hpctrain.data import TokenShards
from tests.chat_files import chatml_folder, conversations, write_jsonl

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def shard_chat(inputs, out, tokenizer, **kw):
    kw.setdefault("eot_token", EOT)
    return shard_dataset([str(p) for p in inputs], str(out), tokenizer=str(tokenizer),
                         val_fraction=0, progress=False, format="chat", log=lambda m: None, **kw)


def stream(data):
    """(tokens, loss mask, document starts) of the train split, shards joined."""
    m = read_manifest(str(data))
    toks, masks, starts, at = [], [], [], 0
    for e in shards_of(m, "train"):
        lay = open_shard_layout(os.path.join(str(data), e["file"]), e, m)
        toks.append(np.fromfile(lay.path, lay.dtype, lay.n_tokens, offset=lay.offset))
        masks.append(np.fromfile(lay.path, np.uint8, lay.n_tokens, offset=lay.mask_offset))
        starts.extend((lay.doc_offsets + at).tolist())
        at += lay.n_tokens
    return np.concatenate(toks), np.concatenate(masks), starts + [at]


def test_ids_and_mask_equal_transformers_on_50_conversations(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    convs = conversations(50)
    data = tmp_path / "data"
    m = shard_chat([write_jsonl(tmp_path / "chat.jsonl", convs)], data, tok_dir, shard_tokens=1500)
    assert (m["format_version"], m["format"], m["n_documents"]["train"]) == (2, "chat", 50)
    assert len(m["shards"]) >= 5  # conversations span shard boundaries
    hf = AutoTokenizer.from_pretrained(str(tok_dir.parent), local_files_only=True)
    eot = hf.convert_tokens_to_ids(EOT)
    toks, mask, starts = stream(data)
    assert len(starts) == 51
    for k, msgs in enumerate(convs):
        want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        doc, doc_mask = toks[starts[k]:starts[k + 1]], mask[starts[k]:starts[k + 1]]
        assert doc.tolist() == list(want["input_ids"]) + [eot], k
        assert doc_mask.tolist() == list(want["assistant_masks"]) + [0], k
    assert 0.3 < mask.mean() < 0.8  # assistant turns are about half the text
    assert verify_dataset(str(data)) == []


def test_reader_loss_mask_is_aligned_with_batch(tok_dir, tmp_path):
    data = tmp_path / "data"
    shard_chat([write_jsonl(tmp_path / "chat.jsonl", conversations(20))], data, tok_dir,
               shard_tokens=700)
    toks, mask, _ = stream(data)
    ds = TokenShards(str(data), "train", block_size=64)
    assert ds.has_loss_mask
    idx = [0, 3, len(ds) - 1, 5]
    batch, lmask = ds.batch(idx).numpy(), ds.loss_mask(idx).numpy()
    assert lmask.shape == batch.shape and lmask.dtype == np.uint8
    for row, i in enumerate(idx):
        s, a = ds.locate(i)
        first = int(sum(ds.shard_tokens[:s])) + a
        assert batch[row].tolist() == toks[first:first + 65].tolist()
        assert lmask[row].tolist() == mask[first:first + 65].tolist()
    assert lmask.sum() > 0 and (lmask == 0).sum() > 0


@pytest.mark.parametrize("line,problem", [
    ({"text": "plain"}, "JSONL line has no non-empty 'messages' list (--format chat)"),
    ({"messages": []}, "JSONL line has no non-empty 'messages' list (--format chat)"),
    ({"messages": [{"role": "bot", "content": "hi"}]},
     "messages[0] has role 'bot' (expected one of system, user, assistant)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]},
     "messages[1] content is not a string"),
])
def test_malformed_line_is_one_error_naming_file_and_line(tok_dir, tmp_path, line, problem):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": conversations(1)[0]})
    path.write_text(good + "\n\n" + json.dumps(line) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        shard_chat([path], tmp_path / "out", tok_dir)
    assert str(err.value) == f"{path}:3: {problem}"
    assert not (tmp_path / "out").exists()


def test_tokenizer_without_template_is_refused(tmp_path):
    tok = chatml_folder(tmp_path / "plain", template=None)
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(2))
    with pytest.raises(DataError) as err:
        shard_chat([path], tmp_path / "out", tok)
    assert str(err.value).startswith(f"{tok}: has no chat template")


def test_end_of_text_inside_a_conversation_is_refused(tok_dir, tmp_path):
    """The config's eos <|im_end|> ends every turn: as the document separator it would split
    conversations, so it is refused naming the first conversation's line."""
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(2))
    with pytest.raises(DataError) as err:
        shard_chat([path], tmp_path / "out", tok_dir, eot_token=None)
    assert str(err.value).startswith(f"{path}:1: the end-of-text id ")


def test_blend_refuses_a_chat_dataset(tok_dir, tmp_path):
    """A blend's reader has no loss masks: blending chat data would train on every token."""
    from data_tools.blend import blend_datasets

    data = tmp_path / "data"
    shard_chat([write_jsonl(tmp_path / "chat.jsonl", conversations(3))], data, tok_dir)
    with pytest.raises(DataError) as err:
        blend_datasets([(str(data), "1")], str(tmp_path / "mix"))
    assert str(err.value).startswith(f"{data / 'manifest.json'}: a chat dataset")


def test_loss_mask_through_the_node_cache(tok_dir, tmp_path):
    """With a NodeCache the mask is read from the node-local copy, as the tokens are."""
    from data_tools.mpiutil import SerialComm
    from hpctrain.data.cache import NodeCache

    data = tmp_path / "data"
    m = shard_chat([write_jsonl(tmp_path / "chat.jsonl", conversations(12))], data, tok_dir,
                   shard_tokens=500)
    plain = TokenShards(str(data), "train", block_size=32)
    cache = NodeCache(str(tmp_path / "cache"), str(data), m, SerialComm(), prefetch=0)
    cached = TokenShards(str(data), "train", block_size=32, cache=cache)
    idx = [len(plain) - 1, 0, 7, 20]
    cache.start(0, 1, lambda k: cached.shard_ids_of(idx).tolist())
    cache.publish(0)
    assert np.array_equal(cached.loss_mask(idx), plain.loss_mask(idx))
    assert np.array_equal(cached.batch(idx), plain.batch(idx))
    cache.close()
    assert plain.loss_mask(idx).sum() > 0


def test_verify_checks_the_loss_mask_length(tok_dir, tmp_path):
    """A shard whose loss_mask is one entry short (its manifest entry updated, so only the mask
    is wrong) is one problem naming the shard."""
    import h5py

    from data_tools.format import sha256_file, write_manifest

    data = tmp_path / "data"
    m = shard_chat([write_jsonl(tmp_path / "chat.jsonl", conversations(4))], data, tok_dir)
    entry = m["shards"][0]
    path = data / entry["file"]
    with h5py.File(path, "r+") as f:
        mask = f["loss_mask"][()]
        del f["loss_mask"]
        f.create_dataset("loss_mask", data=mask[:-1])
    entry.update(bytes=os.path.getsize(path), sha256=sha256_file(str(path)))
    write_manifest(str(data), m)
    (problem,) = verify_dataset(str(data))
    assert problem.startswith(f"{path}: loss_mask ") and f"[{entry['n_tokens'] - 1}]" in problem
