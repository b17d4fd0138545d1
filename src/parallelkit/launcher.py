"""Start one process per local rank for the *current* Hydra job — also inside a ``-m`` sweep.

Lightning re-runs the script for ranks 1..N-1 with the original ``sys.argv`` plus ``hydra.run.dir``.
Inside a multirun that command still carries ``-m`` and the whole sweep, and ``run.dir`` is not the
job's directory, so every child would start a sweep of its own. Here the children get exactly this
job's overrides and its output directory, with no ``-m``. (With an integer ``trainer.devices`` the ranks
are started earlier still, by :mod:`parallelkit.local_launch`, and this launcher starts none.)
"""

from __future__ import annotations

import os
import subprocess

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from parallelkit.local_launch import hydra_job_command


class HydraJobLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher with a multirun-safe command (see the module docstring)."""

    @override
    def _call_children_scripts(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            child_env = os.environ.copy()
            child_env["LOCAL_RANK"] = str(local_rank)
            self.procs.append(subprocess.Popen(hydra_job_command(local_rank), env=child_env, cwd=os.getcwd()))
