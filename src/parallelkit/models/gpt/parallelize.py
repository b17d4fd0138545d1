"""Parallel plans for :mod:`parallelkit.models.gpt`: which weights split how, and where the pipeline cuts.

``model.py`` stays single-device code; the strategies read these plans and apply them with the generic
techniques of :mod:`parallelkit.distributed`.
"""

from __future__ import annotations

# ==================================================================== tensor parallel plan


# ==================================================================== pipeline split points
