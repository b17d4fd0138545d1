from parallelkit.models.mlp.model import MLP

__all__ = ["MLP"]
