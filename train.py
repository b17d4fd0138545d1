"""parallelkit's entry point: ``python train.py strategy=ddp trainer.devices=2 ...`` (see README)."""

from parallelkit import startup_gc
from parallelkit.local_launch import start_before_hydra

if __name__ == "__main__":
    startup_gc.pause()  # until the run is built: the collector would spend ~0.5 s on the imports (see there)
    start_before_hydra()  # `trainer.devices=N` on the command line: ranks 1..N-1 import torch while Hydra composes

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from parallelkit.cli import exit_after, register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from parallelkit.cli import run_or_explain

    run_or_explain(cfg)


if __name__ == "__main__":
    exit_after(main)
