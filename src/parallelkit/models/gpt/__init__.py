from parallelkit.models.gpt.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
