"""The installed command: ``parallelkit strategy=ddp trainer.devices=2 ...`` (or ``python -m parallelkit ...``).

The same overrides and the same run as ``python train.py ...`` in the repository, from any directory, with
the configs packaged with parallelkit (``pkg://parallelkit.conf``); a user's own config directory joins
them with ``hydra.searchpath=[file://./my_conf]`` (then ``model=mynet`` picks ``my_conf/model/mynet.yaml``),
and a user's own package in the working directory is importable by ``_target_`` (:func:`parallelkit.launch.cli.hydra_main`).
"""

from __future__ import annotations

from parallelkit.launch import local_ranks, startup_gc


def main() -> None:
    # The order of train.py, for the same reasons: no collector during the imports (parallelkit.launch.startup_gc),
    # and ranks 1..N-1 importing torch while this process imports Hydra and composes.
    startup_gc.pause()
    from parallelkit.launch.command_line import PACKAGED_CONFIGS

    local_ranks.prepare_process(config_path=PACKAGED_CONFIGS)
    from parallelkit.launch.cli import exit_after, hydra_main

    exit_after(hydra_main(PACKAGED_CONFIGS))


if __name__ == "__main__":
    main()
