"""Model architecture (no distributed code here)."""
from hpctrain.model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
