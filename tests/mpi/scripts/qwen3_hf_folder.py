"""A tiny Qwen3-MoE Hugging Face folder for tests/mpi/test_qwen3.py, built with transformers from a
small config (random weights, never downloaded):

    python qwen3_hf_folder.py OUT

2 layers, 32 wide, 4 heads of 16 (q 64 wide), 2 kv heads, the 257-id byte vocabulary, layer 0
dense (mlp_only_layers [0], SwiGLU 64), layer 1 sparse: 4 experts of 24, top 2, renormalized.
"""
import sys

import torch
import transformers

cfg = transformers.Qwen3MoeConfig(
    vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0],
    rope_theta=1000000.0, rms_norm_eps=1e-6)
torch.manual_seed(11)
model = transformers.AutoModelForCausalLM.from_config(cfg)
with torch.no_grad():  # q/k norms and RMSNorms away from 1, so they matter
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
model.save_pretrained(sys.argv[1])
