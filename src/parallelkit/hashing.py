"""splitmix64: the counter-based hash behind parallelkit's deterministic random numbers.

A pure function of its input, with no generator state, so a number depends only on its keys and not on which
process computes it or in what order: the parameter server's initial rows (:func:`parallelkit.ps.table.init_rows`)
and the CTR data set (:mod:`parallelkit.data.ctr`) come out the same at any layout. Here, not in either of them,
so that the data layer does not reach into the parameter server's internals.
"""

from __future__ import annotations

import numpy as np

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Steele, Lea and Flood's SplitMix64 finaliser, element-wise on ``uint64``."""
    with np.errstate(over="ignore"):  # wrap-around is the point
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & MASK64
        return x ^ (x >> np.uint64(31))
