"""train.objective = "sft" under a real mpiexec, fine-tuning a tiny Llama saved by transformers
(`init.from`) on 60 conversations sharded here with `--format chat` (tests/chat_files.py: the
ChatML template in a chat_template.jinja beside the tokenizer, as transformers 5 writes it):

- step 1's loss is the masked cross-entropy computed here from the same windows, loss masks and
  initial weights (the mean over the assistant tokens of the global batch: 8 windows, 2 micro-
  batches) to 1e-6, and not the unmasked or per-micro-batch mean;
- dp2 (with the chunked loss), FSDP2, tp2 (vocab-sharded chunked loss), pp2 and cp2 train the
  1-rank curve (document masking on, packed conversations apart) within 1e-5;
- a dp2 run stopped at step 3 and resumed has the uninterrupted run's losses, bit for bit;
- `hpctrain export` writes the chat template: transformers' apply_chat_template gives the ids the
  shard holds, and generate runs on the exported model;
- objective sft on a dataset without a loss mask is one line naming the dataset.
"""
import json
import sys

import numpy as np
import pytest
import torch

from data_tools.shard import shard_dataset
from tests.chat_files import CHATML, chatml_folder, conversations, write_jsonl
from tests.conftest import losses, run_cmd
from tests.helpers import assert_same_curve, copy_run_at, train
from tests.hf_models import OFFLINE, make_hf_model

pytestmark = pytest.mark.mpi

EOT = "<|endoftext|>"
SFT = """[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
document_mask = true
[init]
from = "{init}"
[model]
block_size = 64
[train]
objective = "sft"
steps = 6
micro_batch_size = 4
grad_accum = 2
lr = 2e-2
min_lr = 2e-3
warmup_steps = 1
eval_interval = 3
eval_batches = 2
log_interval = 1
[checkpoint]
interval = 3
keep = 3
"""
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
LAYOUTS = {  # name: (ranks, overrides); 8 windows per step in each
    "dp2_chunked": (2, ["--train.grad_accum=1", "--train.loss_chunk=16"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "tp2_chunked": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1",
                        "--train.loss_chunk=16"]),
    "pp2": (2, [*PP, "--parallel.pp_schedule=gpipe"]),
    "cp2": (2, ["--parallel.cp=2"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(chat dataset, HF init folder, the conversations): ChatML template as a .jinja file."""
    root = tmp_path_factory.mktemp("sft")
    tok = chatml_folder(root / "tok", template=None)
    (root / "tok" / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    convs = conversations(60, seed=1)
    data = root / "data"
    shard_dataset([str(write_jsonl(root / "chat.jsonl", convs))], str(data), tokenizer=str(tok),
                  eot_token=EOT, val_fraction=0.15, progress=False, format="chat",
                  shard_tokens=4000, log=lambda m: None)
    init = root / "init"
    make_hf_model("llama_gqa_untied", init, vocab_size=3000, max_position_embeddings=64)
    return data, init, convs


def sft_run(tmp, setup, name, n=1, *overrides, check=True):
    data, init, _ = setup
    cfg = tmp / f"{name}.toml"
    cfg.write_text(SFT.format(run=tmp / name, data=data, init=init))
    return train(n, cfg, *overrides, check=check, timeout=400), tmp / name


@pytest.fixture(scope="module")
def reference(tmp_path_factory, setup):
    """The 1-rank run (4 windows x 2 micro-batches a step)."""
    _, run = sft_run(tmp_path_factory.mktemp("sft_one"), setup, "one")
    return run


def step_one_batch(data, split="train"):
    """Step 1's 8 windows, their loss masks and document ids, as the trainer's sampler orders them
    (split "val": the 8 validation windows, 2 micro-batches of 4 as the 1-rank run evaluates)."""
    from hpctrain.config_schema import DataConfig
    from hpctrain.data import make_sampler, open_split

    d = {f: DataConfig.__dataclass_fields__[f].default for f in ("shuffle", "shuffle_block_shards")}
    reader = open_split(str(data), split, 64)
    indices = (reader.eval_indices(8) if split == "val" else
               make_sampler(reader, 8, 1337, d["shuffle"], d["shuffle_block_shards"]).next_indices())
    return reader.batch(indices).long(), reader.loss_mask(indices).bool(), reader.document_ids(indices)


def token_losses(init, tokens, doc_ids):
    """Per-target cross-entropy [8, 64] of the initial weights, documents apart (as document_mask)."""
    import hpctrain

    model = hpctrain.load(init, device="cpu").model
    with torch.no_grad():
        logits = model(tokens[:, :-1], doc_ids=torch.as_tensor(doc_ids[:, :-1]))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(),
                                             reduction="none").view(8, 64)


def test_step_one_loss_is_the_masked_mean_over_the_global_batch(setup, reference):
    data, init, _ = setup
    tokens, mask, doc_ids = step_one_batch(data)
    ce, trained = token_losses(init, tokens, doc_ids).double(), mask[:, 1:]
    want = (ce[trained].sum() / trained.sum()).item()
    got = losses(reference)[1]
    assert abs(got - want) <= 1e-6 * want, (got, want)
    halves = (slice(0, 4), slice(4, 8))  # the two micro-batches
    per_micro = np.mean([(ce[r][trained[r]].sum() / trained[r].sum()).item() for r in halves])
    assert 0.1 < trained.float().mean() < 0.9  # some targets are masked out
    assert abs(ce.mean().item() - want) > 1e-3 and abs(per_micro - want) > 1e-5  # both wrong
    tokens, mask, doc_ids = step_one_batch(data, "val")  # validation: the same mean at step 0
    ce, trained = token_losses(init, tokens, doc_ids).double(), mask[:, 1:]
    want = (ce[trained].sum() / trained.sum()).item()
    got = losses(reference, "val_loss")
    assert sorted(got) == [0, 3, 6] and abs(got[0] - want) <= 1e-6 * want, (got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_rank(tmp_path, setup, reference, layout):
    n, overrides = LAYOUTS[layout]
    _, run = sft_run(tmp_path, setup, layout, n, *overrides)
    ref = losses(reference)
    assert_same_curve(ref, losses(run), range(1, 7))
    assert ref[6] < ref[1] - 0.1  # it learns


def test_dp2_resume_is_bit_exact(tmp_path, setup):
    _, straight = sft_run(tmp_path, setup, "straight", 2, "--train.grad_accum=1")
    copy_run_at(straight, tmp_path / "resumed", 3)
    data, init, _ = setup
    cfg = tmp_path / "resumed.toml"
    cfg.write_text(SFT.format(run=tmp_path / "resumed", data=data, init=init))
    train(2, cfg, "--train.grad_accum=1", timeout=400)
    a, b = losses(straight), losses(tmp_path / "resumed")
    assert sorted(b) == list(range(1, 7)) and all(a[s] == b[s] for s in range(1, 7)), (a, b)


def test_export_applies_the_chat_template_and_generates(tmp_path, setup, reference):
    data, _, convs = setup
    out = tmp_path / "hf"
    run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", reference, "--format",
             "hf", "--output", out], check=True, timeout=300)
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == CHATML
    code = """if True:
        import json, sys, numpy as np, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from data_tools.format import open_shard_layout, read_manifest, shards_of
        out, data, convs = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
        m = read_manifest(data)
        tok = AutoTokenizer.from_pretrained(out)
        ids = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
        eot, stored = tok.convert_tokens_to_ids("<|endoftext|>"), []
        for split in ("train", "val"):  # each split's conversations, end-of-text after each
            lays = [open_shard_layout(f"{data}/{e['file']}", e, m) for e in shards_of(m, split)]
            toks = np.concatenate([np.fromfile(l.path, l.dtype, l.n_tokens, offset=l.offset) for l in lays])
            stored += [[int(t) for t in d] for d in np.split(toks, np.flatnonzero(toks == eot) + 1)[:-1]]
        prompt = tok.apply_chat_template(convs[0][:2], add_generation_prompt=True, return_dict=True,
                                         return_tensors="pt")["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        new = model.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1]:]
        print(json.dumps({"ids": sorted(i + [eot] for i in ids), "stored": sorted(stored),
                          "prompt": prompt[0].tolist(), "new": new.tolist()}))
    """
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    r = run_cmd([sys.executable, "-c", code, out, data, tmp_path / "convs.json"], timeout=300,
                env=OFFLINE, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got["stored"]) == len(convs) and got["ids"] == got["stored"]
    first = next(d for d in got["stored"] if d[:len(got["prompt"])] == got["prompt"])
    assert len(first) > len(got["prompt"]) and len(got["new"]) == 5  # the prompt ends at the answer


def test_sft_on_a_dataset_without_loss_mask_is_one_line(tmp_path, setup, dataset):
    _, init, _ = setup
    cfg = tmp_path / "plain.toml"
    cfg.write_text(SFT.format(run=tmp_path / "plain", data=dataset, init=init))
    r = train(1, cfg, check=False, timeout=300)
    lines = [line for line in r.stderr.splitlines() if "config key 'train.objective'" in line]
    assert r.returncode != 0 and lines, r.stderr[-2000:]
    assert str(dataset) in lines[0] and "--format chat" in lines[0], lines[0]
