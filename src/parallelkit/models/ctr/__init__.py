from parallelkit.models.ctr.model import CTRModel

__all__ = ["CTRModel"]
