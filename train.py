"""parallelkit's entry point: ``python train.py strategy=ddp trainer.devices=2 ...`` (see README)."""

import hydra
from omegaconf import DictConfig

from parallelkit.cli import exit_after, register_resolvers

register_resolvers()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from parallelkit.cli import run_or_explain

    run_or_explain(cfg)


if __name__ == "__main__":
    exit_after(main)
