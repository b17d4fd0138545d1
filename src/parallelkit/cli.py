"""The glue between ``train.py`` and :func:`parallelkit.run.run`: resolvers, clear errors, clean exits."""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from parallelkit.errors import ConfigError

EXIT_CONFIG_ERROR = 2


def run_name(override_dirname: str) -> str:
    """A run directory name from the command-line overrides: the same on every rank, ``default`` if none."""
    return re.sub(r"[/\\\s]", "_", override_dirname) or "default"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("pk_run_name"):
        OmegaConf.register_new_resolver("pk_run_name", run_name)


def run_or_explain(cfg: DictConfig) -> None:
    """Run; a :class:`ConfigError` becomes one paragraph on stderr and exit code 2, not a traceback."""
    from parallelkit.run import run

    try:
        run(cfg)
    except ConfigError as err:
        print(f"parallelkit: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None


def exit_after(main: Callable[[], None]) -> None:
    """Call ``main`` and leave the process with its exit code, skipping interpreter shutdown.

    gloo's process-group destructors abort (SIGABRT) about once in five runs while Python shuts down,
    after all work is done. A run that finished must exit 0 every time, so once ``main`` returns (its
    outputs written, the process group destroyed) the process ends with ``os._exit``.
    """
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
