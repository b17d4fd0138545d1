"""The rank grid of a dry-run :class:`~parallelkit.planner.dry_run.Plan`, drawn to a PNG (one panel per mesh axis).

matplotlib is imported inside :func:`draw_plan`, and this module only when a picture is asked for: the planner
must import without it (it is a ``dev``/``bench`` extra, not a runtime dependency).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from parallelkit.distributed.parallel_dims import CP, DP, EP, PP, SHARDING, TP

if TYPE_CHECKING:
    from parallelkit.planner.dry_run import Plan


def draw_plan(plan: Plan, path: Path) -> Path:
    """One panel per axis: the rank grid, each cell coloured by the rank's index on that axis, labelled
    with its rank."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan.dims
    # A near-square grid whose rows hold whole innermost (tp) groups: rank = row · cols + col.
    fits = [c for c in range(d.mesh_shape[-1], d.world_size + 1, d.mesh_shape[-1]) if d.world_size % c == 0]
    cols = min(fits, key=lambda c: abs(c - math.sqrt(d.world_size)))
    rows = d.world_size // cols
    panels = (PP, DP, SHARDING, CP, TP, EP) if d.cp > 1 else (PP, DP, SHARDING, TP, EP)  # cp's panel where it is on
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4 * rows / cols + 1.2), squeeze=False)
    for ax, axis in zip(axes[0], panels):
        grid = np.zeros((rows, cols))
        for r in plan.ranks:
            grid[r.rank // cols, r.rank % cols] = r.coords[axis]
        degree = d.as_dict()[axis]
        # Distinct colours per index: qualitative maps up to 20, a continuous one beyond.
        cmap, top = ("tab10", 9) if degree <= 10 else ("tab20", 19) if degree <= 20 else ("turbo", degree - 1)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=top, aspect="auto")
        for r in plan.ranks:
            ax.text(r.rank % cols, r.rank // cols, str(r.rank), ha="center", va="center", fontsize=6)
        ax.set_title(f"{axis} (degree {d.as_dict()[axis]})")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{plan.strategy}: {d.world_size} ranks, {d.as_dict()}, mesh {'×'.join(d.mesh_order)}; colour = index on the axis")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
