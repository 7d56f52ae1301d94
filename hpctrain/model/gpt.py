"""The import path of GPT from before model families had folders: hpctrain/model/gpt2/model.py."""
from hpctrain.model.gpt2.model import *  # noqa: F401,F403
from hpctrain.model.gpt2.model import Block, CausalSelfAttention, GPT, GPTConfig, MLP  # noqa: F401
