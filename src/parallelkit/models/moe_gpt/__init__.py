from parallelkit.models.moe_gpt.model import GroupedExperts, MoEGPT, MoELayer

__all__ = ["GroupedExperts", "MoEGPT", "MoELayer"]
