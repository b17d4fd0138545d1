"""Parallel plans for :mod:`parallelkit.models.mlp`.

Empty on purpose: data parallelism needs no plan; later techniques add theirs here.
"""
