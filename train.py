"""parallelkit's entry point: ``python train.py strategy=ddp trainer.devices=2 ...`` (see README).

Installed (``pip install .``), the ``parallelkit`` command does the same from any directory
(:mod:`parallelkit.__main__`); both share :func:`parallelkit.launch.cli.hydra_main`.
"""

from pathlib import Path

from parallelkit.launch import local_ranks, startup_gc

if __name__ == "__main__":
    startup_gc.pause()  # until the run is built: the collector would spend ~0.5 s on the imports (see there)
    # `trainer.devices=N` on the command line: ranks 1..N-1 start importing now, if the strategy's degrees fit N
    local_ranks.prepare_process(config_path=str(Path(__file__).resolve().parent / "conf"))

from parallelkit.launch.cli import exit_after, hydra_main  # noqa: E402 - imports Hydra (lazily, in hydra_main)

# This checkout's conf/ itself, not pkg://parallelkit.conf: that package exists only once this checkout is
# installed with the current pyproject.toml, and PYTHONPATH=src (the tests' warm launcher) or an older
# editable install would find the code but no configs.
main = hydra_main(str(Path(__file__).resolve().parent / "conf"))

if __name__ == "__main__":
    exit_after(main)
