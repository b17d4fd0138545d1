"""Hugging Face ``transformers`` causal language models as parallelkit models (``model=hf``)."""

from parallelkit.models.hf.model import HFCausalLM

__all__ = ["HFCausalLM"]
