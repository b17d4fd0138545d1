"""Parallel plans for :mod:`parallelkit.models.segmenter`.

Empty on purpose: a small convolutional network is trained data-parallel (ddp, zero); the large input is
what gets split, into tiles, by ``data=raster``.
"""
