"""What a run prints on the terminal: each log line once, on stderr, and no warning that is not the user's.

Two handlers used to print every Lightning log line: the ``lightning`` package adds its own console handler
(``INFO: ...`` on stderr) at import, and Hydra's job logging gives the root logger a console handler (stdout)
and the run's log file. :func:`quiet_console` leaves one console handler, Hydra's, writing to stderr in
Lightning's short format (``conf/train.yaml`` ``hydra.job_logging``); the log file keeps every line, with
times and logger names.

On that console it drops Lightning's start-up chatter that says nothing about this run (:data:`CHATTER`: TPU
cores, an advertisement, one "Initializing distributed" line per rank, the process-group banner; the
summary table names the strategy and the process count), and it silences warnings that come from Lightning's (or torch's)
own code on every rank and that no user setting can address (:data:`LIBRARY_WARNINGS`).
"""

from __future__ import annotations

import logging
import warnings

# Lightning's INFO lines that a user of parallelkit does not need on the terminal (still in the log file).
CHATTER = (
    "TPU available:",
    "HPU available:",
    "💡 Tip:",
    "Initializing distributed:",
    "distributed_backend=",  # the "All distributed processes registered" banner
)

# (message regex, category, module regex): warnings raised inside Lightning or torch by their own calls, on every rank.
LIBRARY_WARNINGS = (
    # lightning.pytorch.utilities._pytree builds torch's deprecated LeafSpec (torch 2.13); Lightning's to fix.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # torch.distributed.rpc's start-up gathers over a ProcessGroupGloo it builds itself (rpc/backend_registry.py),
    # a usage torch deprecates in its own object collectives (strategy=ps: once per rank); torch's to fix.
    (r"You are using a Backend <class 'torch\.distributed\.distributed_c10d\.ProcessGroupGloo'> as a ProcessGroup",
     UserWarning, r"torch\.distributed\.distributed_c10d"),
)


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage().lstrip("-\n ")
        return not message.startswith(CHATTER)


def _is_console(handler: logging.Handler) -> bool:
    return type(handler) is logging.StreamHandler  # FileHandler is a subclass: the log file keeps everything


def silence_library_warnings() -> None:
    """Ignore :data:`LIBRARY_WARNINGS` (idempotent): at ``import parallelkit``, so that a LightningModule trained
    with parallelkit's strategies in plain Python (no Hydra, no :func:`quiet_console`) is spared them too."""
    for message, category, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_console() -> None:
    """Route Lightning's log lines through the root logger's handlers only and filter the console (idempotent).

    Does nothing to the handlers when logging was not configured (``hydra/job_logging=none``, or Lightning
    used without Hydra): then Lightning's own handler is the only console and stays.
    """
    import lightning  # noqa: F401 - its __init__ adds the console handler taken off below: it must have run

    silence_library_warnings()
    root = logging.getLogger()
    if not any(_is_console(h) for h in root.handlers):
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if _is_console(h)]:
            logger.removeHandler(handler)
        logger.propagate = True
    for handler in root.handlers:
        if _is_console(handler) and not any(isinstance(f, _DropChatter) for f in handler.filters):
            handler.addFilter(_DropChatter())
