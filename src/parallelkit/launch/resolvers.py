"""The config's own resolvers (``conf/train.yaml``): the run directory's name, each rank's log file, and who writes
Hydra's record of the composed config. Every rank composes its config, so these answer per process."""

from __future__ import annotations

import os
import re

from omegaconf import OmegaConf

MAX_RUN_NAME = 120


def run_name(override_dirname: str) -> str:
    """A run directory name from the command-line overrides: the same on every rank, ``default`` if none.

    Path separators and spaces are replaced; when that changed anything (``a/b`` and ``a_b`` would collide)
    or the name is long (file names stop at 255 bytes), a short hash of the exact overrides is appended.
    """
    import hashlib

    safe = re.sub(r"[/\\\s]", "_", override_dirname)
    if safe == override_dirname and len(safe) <= MAX_RUN_NAME:
        return safe or "default"
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:8]
    return f"{safe[:MAX_RUN_NAME]}-{digest}"


def launcher_rank() -> int:
    """The global rank a launcher (torchrun, SLURM, a local rank 0: parallelkit.launch.local_ranks) gave this process; 0 otherwise."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def rank_suffix() -> str:
    """``_rankN`` for ranks > 0 started by torchrun/SLURM, so ranks do not share one log file."""
    rank = launcher_rank()
    return f"_rank{rank}" if rank else ""


def rank_zero_value(value: str) -> str | None:
    """``value`` on rank 0, ``None`` elsewhere: only rank 0 writes the composed config (.hydra/)."""
    return value if launcher_rank() == 0 else None


_CONFIG_SUBDIRS: dict[str, str] = {}  # run directory → this process's choice (Hydra reads the setting twice)
# Run directory → what it held before this job (Hydra has created it and opened the job's log file by the time
# it asks for the config's subdirectory): a refused job takes back what it added (forget_refused_job).
_HELD_BEFORE: dict[str, frozenset[str]] = {}


def _held_before(output_dir: str) -> frozenset[str]:
    """The directory's entries, without the log files this job (or its early-started ranks) just created empty."""
    def just_created(name: str) -> bool:
        path = os.path.join(output_dir, name)
        return name.endswith(".log") and os.path.isfile(path) and os.path.getsize(path) == 0

    try:
        return frozenset(name for name in os.listdir(output_dir) if not just_created(name))
    except OSError:
        return frozenset()


def forget_refused_job(output_dir: str) -> None:
    """Rank 0 of a job refused before training: the run directory as it was. A directory the job created goes
    (``.hydra/``, empty logs: "nothing written"); in an earlier run's directory only this job's ``.hydra-N/``
    record and log files go, so that the next real run writes ``.hydra/`` (or the next free ``.hydra-N/``)."""
    import shutil

    output_dir = os.path.abspath(output_dir)
    before = _HELD_BEFORE.pop(output_dir, None)
    _CONFIG_SUBDIRS.pop(output_dir, None)
    if before is None or not os.path.isdir(output_dir):
        return
    if not before and not os.path.abspath(os.getcwd()).startswith(output_dir):
        shutil.rmtree(output_dir, ignore_errors=True)
        return
    for name in set(os.listdir(output_dir)) - before:
        path = os.path.join(output_dir, name)
        if name.startswith(".hydra") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".log"):
            os.remove(path)


def config_subdir(output_dir: str) -> str | None:
    """Where Hydra writes this job's composed config, on rank 0 (``None`` elsewhere): ``.hydra``, or ``.hydra-2``,
    ``.hydra-3``, ... when an earlier run in the same directory (a resume, a repeated run) holds ``.hydra``:
    Hydra would overwrite that record of how the earlier run was started."""
    if launcher_rank() != 0:
        return None
    if output_dir not in _CONFIG_SUBDIRS:
        _HELD_BEFORE[os.path.abspath(output_dir)] = _held_before(output_dir)
        name, n = ".hydra", 1
        while os.path.exists(os.path.join(output_dir, name)):
            n += 1
            name = f".hydra-{n}"
        _CONFIG_SUBDIRS[output_dir] = name
    return _CONFIG_SUBDIRS[output_dir]


def register_resolvers() -> None:
    for name, fn in (("pk_run_name", run_name), ("pk_rank_suffix", rank_suffix), ("pk_rank_zero", rank_zero_value),
                     ("pk_config_subdir", config_subdir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


