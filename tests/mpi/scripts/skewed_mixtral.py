"""Write a tiny Mixtral (transformers, random weights) whose routing is deliberately unbalanced,
for the expert-parallel training tests: every token embedding carries +0.3 in dimension 0 and the
routers favour experts 0 and 1 along it, so most routed rows go to two of the experts.
Usage: python skewed_mixtral.py FOLDER N_EXPERTS"""
import sys

import torch
import transformers

folder, n_experts = sys.argv[1], int(sys.argv[2])
cfg = transformers.MixtralConfig(vocab_size=257, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=32, num_local_experts=n_experts,
                                 num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
torch.manual_seed(5)
hf = transformers.AutoModelForCausalLM.from_config(cfg)
with torch.no_grad():
    for p in hf.parameters():  # larger than init-time values: a few steps move the loss
        if p.dim() >= 2:
            p.normal_(0.0, 0.1)
    hf.model.embed_tokens.weight[:, 0] = 0.3
    for layer in hf.model.layers:
        moe = getattr(layer, "block_sparse_moe", None) or layer.mlp  # transformers < 5 | >= 5
        moe.gate.weight[0, 0] = 1.0
        moe.gate.weight[1, 0] = 0.6
hf.save_pretrained(folder)
# the folder is written and closed: end without the interpreter's teardown of torch + transformers
from hpctrain.__main__ import exit_without_teardown  # noqa: E402

exit_without_teardown(0)
