"""train.objective = sft, in one process: the global trained-token mean the runner's arithmetic
gives with D (hpctrain/parallel/token_mean.py), masked targets (plain, documents, cp parts) that
get no gradient, the chunked loss with a denominator, the objective's one-line refusals and
warning, and chat_template.jinja carried by checkpoints and written by export."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from data_tools.tokenizer_files import write_hf_tokenizer
from data_tools.tokenizers import tokenizer_file_of
from hpctrain import config
from hpctrain.data.documents import DocumentBatch
from hpctrain.errors import ConfigError
from hpctrain.parallel.loss import IGNORE_INDEX, chunked_lm_loss
from hpctrain.parallel.runner import model_inputs
from hpctrain.parallel.token_mean import lm_loss_sum, per_micro_batch_denominator, trained_count
from hpctrain.parallel.zigzag import split_for_rank
from hpctrain.train.objective import OBJECTIVES, check_objective, masked_batch


def build(data="d", **train):
    return config.from_dict({"run": {"dir": "r"}, "data": {"path": data},
                             "model": {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8,
                                       "vocab_size": 16},
                             "train": {"steps": 20, "micro_batch_size": 1, **train}}, "test.toml")


def test_denominator_gives_the_global_token_mean_whatever_the_split():
    """n micro-batches on R ranks, each loss = its sum / D, averaged as the runner does (1/n per
    micro-batch, then the mean over ranks): sum / N over every trained token."""
    g = torch.Generator().manual_seed(0)
    n, ranks = 3, 2
    ce = torch.rand(ranks, n, 4, 16, generator=g, dtype=torch.float64)
    share = torch.linspace(0.05, 0.9, n * ranks).view(ranks, n, 1, 1)  # trained share per micro-batch
    trained = torch.rand(ranks, n, 4, 16, generator=g) < share
    targets = torch.where(trained, 1, IGNORE_INDEX)
    counts = [trained_count(list(targets[r])) for r in range(ranks)]
    d = per_micro_batch_denominator(sum(counts), n, ranks)
    step = sum(sum((ce[r, i] * trained[r, i]).sum() / d for i in range(n)) / n for r in range(ranks)) / ranks
    want = (ce * trained).sum() / trained.sum()
    assert abs(step.item() - want.item()) < 1e-6 * want.item()
    per_micro = torch.stack([(ce[r, i] * trained[r, i]).sum() / trained[r, i].sum()
                             for r in range(ranks) for i in range(n)]).mean()
    assert abs(per_micro.item() - want.item()) > 1e-3  # the per-micro-batch mean is another number
    assert per_micro_batch_denominator(torch.tensor(0), n, ranks).item() > 0  # no token: loss 0


def test_masked_targets_plain_documents_and_cp_parts():
    tokens = torch.arange(2 * 9).view(2, 9)
    mask = (torch.arange(2 * 9).view(2, 9) % 3 != 0).to(torch.uint8)
    inputs, keywords, targets = model_inputs(masked_batch(tokens, mask))
    assert torch.equal(inputs, tokens[:, :-1]) and keywords == {}
    assert torch.equal(targets, torch.where(mask[:, 1:].bool(), tokens[:, 1:], IGNORE_INDEX))
    docs = DocumentBatch(tokens, torch.zeros_like(tokens), None)
    _, keywords, doc_targets = model_inputs(masked_batch(docs, mask))
    assert torch.equal(doc_targets, targets) and set(keywords) == {"doc_ids"}
    for rank in (0, 1):  # parallel.cp = 2: the rank's zig-zag part of the masked targets
        local = masked_batch(tokens[:, :9], mask, cp=(2, rank))
        assert torch.equal(model_inputs(local)[2], split_for_rank(targets, 2, rank))


def _loss_and_grads(tokens, mask, chunk):
    """The sft loss of a tiny embedding + head model, and its gradients."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    inputs, _, targets = model_inputs(masked_batch(tokens, mask))
    d = per_micro_batch_denominator(trained_count([targets]), 1, 1)
    h = emb(inputs)
    loss = (chunked_lm_loss(h, head.weight, targets, chunk, denominator=d) if chunk
            else lm_loss_sum(head(h), targets) / d)
    loss.backward()
    return loss.detach(), [emb.weight.grad, head.weight.grad]


@pytest.mark.parametrize("chunk", [0, 5])
def test_a_masked_target_gets_no_gradient(chunk):
    """The last token is only a target: changed where masked, loss and gradients are the same
    bits; where trained, they change. The chunked loss gives the plain one's numbers."""
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.uint8)
    mask[0, -1], mask[1, :4] = 0, 0
    loss, grads = _loss_and_grads(tokens, mask, chunk)
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % 16
    loss2, grads2 = _loss_and_grads(changed, mask, chunk)
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    changed = tokens.clone()
    changed[1, -1] = (tokens[1, -1] + 1) % 16
    loss3, _ = _loss_and_grads(changed, mask, chunk)
    assert not torch.equal(loss, loss3)
    plain, plain_grads = _loss_and_grads(tokens, mask, 0)
    assert torch.allclose(loss, plain, rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, plain_grads))


def test_objectives_and_their_one_line_refusals(caplog):
    assert build().train.objective == "pretrain" and set(OBJECTIVES) >= {"pretrain", "sft"}
    with pytest.raises(ConfigError, match=r"'train.objective': 'sft' .* dataset /x/plain .*--format chat"):
        check_objective(build("/x/plain", objective="sft"), has_loss_mask=False, is_main=True)
    diloco = build(objective="sft")
    diloco.sync.mode = "diloco"
    with pytest.raises(ConfigError, match=r"'train.objective': 'sft' needs sync.mode = 'sync' "
                                          r"\(got 'diloco'"):
        check_objective(diloco, has_loss_mask=True, is_main=True)
    assert check_objective(build(objective="sft"), has_loss_mask=True, is_main=True).token_mean
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert not check_objective(build("/x/chat"), has_loss_mask=True, is_main=True).loss_mask
    assert any("/x/chat" in r.getMessage() and "train.objective = 'sft'" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="train.objective"):
        build(objective="dpo_typo")


def test_chat_template_file_travels_to_the_export(tmp_path):
    """A chat_template.jinja beside the dataset's tokenizer is carried in the record checkpoints
    keep and written by export (the dataset gone); a chat dataset's special tokens are not split."""
    from tests.chat_files import CHATML, chatml_folder

    tok = chatml_folder(tmp_path / "data", template=None)
    (tmp_path / "data" / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    from data_tools.format import sha256_file

    info = {"name": "tokenizer.json", "file": "tokenizer.json", "sha256": sha256_file(str(tok)),
            "eot_id": 0}
    info.update(tokenizer_file_of(str(tmp_path / "data"), {"tokenizer": info}))
    assert info["files"]["chat_template.jinja"] == CHATML
    (tmp_path / "data" / "chat_template.jinja").unlink()  # the dataset moved: the record has it
    out = tmp_path / "out"
    out.mkdir()
    names = write_hf_tokenizer(info, str(tmp_path / "data"), str(out))
    assert "chat_template.jinja" in names
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == CHATML
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" not in written and written["split_special_tokens"] is True
    write_hf_tokenizer({**info, "format": "chat"}, str(tmp_path / "data"), str(out))
    # a chat dataset's ids hold <|im_start|> as its special id (as `shard --format chat` encodes)
    assert json.loads((out / "tokenizer_config.json").read_text())["split_special_tokens"] is False


def test_the_sft_recipe_loads_with_an_init_folder(tmp_path):
    """configs/sft.toml with --init.from a Hugging Face folder: [model] from its config.json."""
    from tests.conftest import ROOT
    from tests.hf_models import make_hf_model

    make_hf_model("llama_gqa_untied", tmp_path / "base", max_position_embeddings=2048)
    cfg = config.load(ROOT / "configs" / "sft.toml", [f"--init.from={tmp_path / 'base'}"])
    assert (cfg.train.objective, cfg.data.document_mask, cfg.model.arch) == ("sft", True, "llama")
    assert (cfg.model.n_kv_head, cfg.model.block_size) == (2, 1024)
