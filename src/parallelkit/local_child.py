"""An early-started local rank (``python -m parallelkit.local_child``, started by :mod:`parallelkit.local_launch`).

It imports torch and Lightning at once, while rank 0 composes the config, then takes the composed config
from rank 0 on its stdin instead of running Hydra itself, sets up the per-rank log file Hydra would have
given it, and runs the job like ``train.py`` does.
"""

from __future__ import annotations

import logging.config
import os
import sys


def main(forked: bool = False) -> None:
    from parallelkit import startup_gc

    startup_gc.pause()  # resumed once the run is built (parallelkit.startup_gc)
    # The heavy imports first: this is what the early start overlaps with rank 0's Hydra composition.
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    from parallelkit import local_launch

    if forked:  # forked from a warm launcher: what was read from the environment at import time is rank 0's
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

        rank_zero_only.rank = utils_rank_zero_only.rank = int(os.environ["LOCAL_RANK"])
        local_launch._PARENT_PID = os.getppid()

    payload = local_launch.receive_config()
    if payload is None:  # rank 0 stopped (bad input, --help, another world size): leave without a word
        sys.stdout.flush()
        os._exit(0)
    from omegaconf import OmegaConf

    from parallelkit.cli import exit_after, run_or_explain

    # Where rank 0 imports the user's own _target_s from: beside `python train.py`, or the working directory
    # of the `parallelkit` command (this child's `-m` start put its cwd, the same, on sys.path unless -P).
    for path in (payload.get("cwd"), payload["script_dir"]):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    if payload.get("logging"):
        os.makedirs(os.path.dirname(payload["logging"]["handlers"]["file"]["filename"]), exist_ok=True)
        logging.config.dictConfig(payload["logging"])
    cfg = OmegaConf.create(payload["config"])
    OmegaConf.set_struct(cfg, True)  # as Hydra composes it: a misspelt key is an error, not None
    exit_after(lambda: run_or_explain(cfg))


if __name__ == "__main__":
    main()
