"""lm-evaluation-harness over our checkpoints: `hpctrain lm-eval --model hpctrain --model_args
path=RUN_DIR[,step=N,device=cpu] --tasks ...` (lm_eval's own command line, with this model class
registered as `hpctrain`; lm_eval finds no model classes outside its own package by itself).

The class scores as lm_eval's `hf` backend scores the folder `hpctrain export --format hf` writes
(docs/evaluation.md): the same context/continuation split (lm_eval's TemplateLM), inputs cut to the
last block_size tokens, the continuation's fp32 log-softmax summed, greedy = every continuation
token is the argmax; rolling log-likelihoods over lm_eval's disjoint windows; greedy generation
(hpctrain.load's `generate`) cut at the first `until` string.

Owns: the lm_eval model class. The model and tokenizer come from hpctrain.load (hpctrain/api.py).
Import it only with the `eval` extra installed (lm_eval); training never imports it.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


@register_model("hpctrain")
class HpctrainLM(TemplateLM):
    """A run directory, step_N checkpoint or Hugging Face folder as an lm_eval model."""

    def __init__(self, path: str, step: int | None = None, device: str | None = None,
                 max_gen_toks: int = 256, **_ignored):
        """`**_ignored`: lm_eval's batch_size and max_batch_size (one sequence per forward here)."""
        super().__init__()
        from hpctrain.api import load_as

        self.lm = load_as(path, device=device, step=None if step is None else int(step))
        self.max_length, self.max_gen_toks = self.lm.block_size, int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.lm.eos_ids[0] if self.lm.eos_ids else self.lm.tokenizer.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.lm.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.lm.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probabilities, greedy) of each (_, context, continuation)
        request, one forward pass each over its last block_size + 1 tokens but the last."""
        out = []
        for cache_key, context, continuation in requests:
            ids = (context + continuation)[-(self.max_length + 1):][:-1]
            logprobs = F.log_softmax(self.lm.logits(ids), dim=-1)[-len(continuation):]
            target = torch.tensor(continuation, device=logprobs.device)
            result = (float(logprobs.gather(1, target[:, None]).sum()),
                      bool((logprobs.argmax(-1) == target).all()))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, over lm_eval's disjoint windows of max_length tokens
        (the first predicted from the end-of-text token), as its hf backend takes them."""
        out = []
        for (string,) in [req.args for req in requests]:
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, *w) for w in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of each context (at most max_gen_toks tokens), cut before the
        first of its `until` strings."""
        out = []
        for context, gen_kwargs in [req.args for req in requests]:
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            n_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = (self.tok_encode(context) or [self.eot_token_id])[-self.max_length:]
            text = self.tok_decode(self.lm.generate(ids, max_new_tokens=n_new)[len(ids):])
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def main(argv: list[str]) -> int:
    """`hpctrain lm-eval ARGS`: lm_eval's command line with the `hpctrain` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0
