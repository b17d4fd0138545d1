from parallelkit.models.segmenter.model import TileSegmenter

__all__ = ["TileSegmenter"]
