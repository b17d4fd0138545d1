"""Parallel plans for :mod:`parallelkit.models.gpt`.

Empty on purpose: data parallelism needs no plan. The tensor-parallel layout (column/row-parallel
projections, vocab-parallel embedding and loss), the pipeline split points and activation recomputation
for this model are added here by the issues that bring those techniques, so ``model.py`` stays
single-device code.
"""
