"""The glue between the entry points (``train.py``, the ``parallelkit`` command) and :func:`parallelkit.job.run`:
the shared Hydra main, resolvers, the launcher's hooks handed to the run, clear errors, clean exits."""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Callable

from omegaconf import DictConfig

from parallelkit.errors import ConfigError, TrainingDiverged, WriteFailed
from parallelkit.launch.command_line import PACKAGED_CONFIGS  # noqa: F401 - its historical home
from parallelkit.launch.resolvers import register_resolvers

EXIT_CONFIG_ERROR = 2
EXIT_PEER_FAILURE = 3
EXIT_DIVERGED = 4  # the loss became NaN/inf
EXIT_WRITE_FAILED = 5  # an output (a checkpoint) could not be written; the previous one is intact
EXIT_SIGTERM = 128 + 15  # the shell's convention for a process ended by SIGTERM


def hydra_main(config_path: str) -> Callable[[], None]:
    """The Hydra entry shared by ``train.py`` and the ``parallelkit`` command, reading ``config_path``.

    Hydra is imported here, not at the top of this module: the entry points start the local ranks before
    they import it (:func:`parallelkit.launch.local_ranks.prepare_process`). The job name (log file
    ``train.log``, ranks' ``train_rankN.log``) is set in ``conf/train.yaml``: Hydra would otherwise name
    the job after the module that defines this function (``cli``), not after ``train.py``.
    """
    import hydra

    # `python -m` puts the working directory first on sys.path; a script puts its own directory there instead
    # (train.py's checkout, the console script's bin/). Either way the user's package beside them must import
    # (`model._target_=mypkg.Net`, `strategy.plan=mypkg.parallelize`); the local ranks get the same path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    register_resolvers()

    @hydra.main(config_path=config_path, config_name="train", version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run_or_explain(cfg)

    def entry() -> None:
        """parallelkit's own ``--help``, ``--version`` and ``examples DIR``; ``G._target_=X`` alone replaces group G
        (:func:`~parallelkit.launch.command_line.replace_groups_by_target`); then Hydra."""
        from parallelkit.launch import command_line as cl

        args = sys.argv[1:]
        if args[:1] == ["examples"]:
            if len(args) != 2:
                raise SystemExit(f"usage: {cl.invoked_as()} examples DIR   (writes the examples into DIR)")
            print(cl.write_examples(args[1]))
        elif "--version" in args:
            print(cl.version_text())
        elif "-h" in args or "--help" in args:
            print(cl.help_text(config_path, [a for a in args if a not in ("-h", "--help")]))
        else:
            sys.argv[1:] = cl.replace_groups_by_target(args, list(cl.config_groups(config_path)))
            main()

    return entry


# Whether a job of this process failed with an exception (Hydra reports it and exits 1): tells exit_after
# Hydra's own exit 1 for a bug in a job from its exit 1 for a command line that did not compose.
_job_raised = False


def run_or_explain(cfg: DictConfig) -> None:
    """Run; a :class:`ConfigError` becomes one paragraph on stderr and exit code 2, not a traceback."""
    global _job_raised
    try:
        _run_or_explain(cfg)
    except SystemExit as stop:
        _job_raised = stop.code not in (0, None)
        raise
    except BaseException:
        _job_raised = True
        raise


def _run_or_explain(cfg: DictConfig) -> None:
    from parallelkit.console import quiet_console
    from parallelkit.launch import local_ranks

    local_ranks.composed()  # a started rank's stderr was held back until now (bad input is rank 0's to report)
    quiet_console()  # logging is configured now (Hydra's): each line once
    if _multirun() and (local_ranks.is_started_rank() or local_ranks.started_before_hydra()):
        # hydra.mode=MULTIRUN from a config file, invisible on the command line: each job starts its own ranks
        if local_ranks.is_started_rank():
            os._exit(0)
        local_ranks.abort()
    finished = refused = False
    try:
        with local_ranks.job_environment():
            try:
                from parallelkit.job import run

                run(cfg, launch_hooks())
            except BaseException:
                if local_ranks.is_started_rank() and not local_ranks.joined():
                    local_ranks.defer_to_rank0()  # rank 0 builds the same run: its verdict decides (see there)
                raise
            finished = True
    except ConfigError as err:
        print(f"parallelkit: error: {err}", file=sys.stderr, flush=True)
        refused = True
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except TrainingDiverged as err:
        print(f"parallelkit: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DIVERGED) from None
    except WriteFailed as err:
        if err.report:  # every rank learns of a sharded write's failure; one of them says it
            print(f"parallelkit: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_WRITE_FAILED) from None
    except RuntimeError as err:
        if not is_peer_failure(err):
            raise
        first_line = str(err).strip().splitlines()[0]
        known = local_ranks.failed_peers() + list(getattr(err, "__notes__", []))
        explained = [code for code in peer_exit_codes(known) if code in SELF_EXPLAINED]
        if explained:  # that rank printed its own error paragraph (a failed write, ...): this one says nothing more
            raise SystemExit(explained[0]) from None
        who = f"another rank stopped or timed out: {'; '.join(known)}" if known else "another rank stopped or timed out"
        print(
            f"parallelkit: error: a collective failed because {who} ({first_line}). "
            "Look at the other ranks' logs in the run directory for the first failure; strategy.timeout_s sets how "
            "long ranks wait for each other.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_PEER_FAILURE) from None
    finally:
        if local_ranks.started():
            local_ranks.finish() if finished else local_ranks.abort()
        if refused and not local_ranks.is_started_rank():  # after its ranks are gone: nothing writes there any more
            _forget_refused_job()


def launch_hooks() -> Any:
    """What the launcher does at the run's milestones (:class:`parallelkit.run.LaunchHooks`), handed to the run
    here so that run code, callbacks and the planner never import ``launch/``."""
    from parallelkit.launch import local_ranks, startup_gc
    from parallelkit.run import LaunchHooks

    return LaunchHooks(is_started_rank=local_ranks.is_started_rank, start_ranks=local_ranks.ensure_started,
                       end_startup=startup_gc.resume, share_cores=local_ranks.share_cores,
                       stop_ranks=lambda: local_ranks.abort(grace_s=1.0))


def _forget_refused_job() -> None:
    """A refused run leaves its run directory as it found it ("exit code 2 and nothing written")."""
    from hydra.core.hydra_config import HydraConfig

    from parallelkit.launch.resolvers import forget_refused_job, launcher_rank

    if HydraConfig.initialized() and launcher_rank() == 0:
        forget_refused_job(HydraConfig.get().runtime.output_dir)


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# Exit codes of a rank that stopped with its own one-paragraph error: a peer that saw it go leaves with the same.
SELF_EXPLAINED = (EXIT_CONFIG_ERROR, EXIT_DIVERGED, EXIT_WRITE_FAILED)


def peer_exit_codes(known: list[str]) -> list[int]:
    """The exit codes in :func:`parallelkit.launch.local_ranks.failed_peers`' lines (``rank 1 exited with code 5``)."""
    return [int(m.group(1)) for m in (re.search(r"exited with code (-?\d+)", line) for line in known) if m]


def is_peer_failure(err: BaseException) -> bool:
    """A collective that failed because of another process, not a bug in this one."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistError) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Socket Timeout")
    )


def exit_after(main: Callable[[], None]) -> None:
    """Call ``main`` and leave the process with its exit code, skipping interpreter shutdown.

    gloo's process-group destructors abort (SIGABRT) about once in five runs while Python shuts down,
    after all work is done. A run that finished must exit 0 every time, so once ``main`` returns (its
    outputs written, the process group destroyed) the process ends with ``os._exit``.

    Hydra reports a command line that does not compose (``model=nope``, a misspelt key) with its own message
    and exit code 1, before any job runs; that is bad input, so it leaves with 2, as parallelkit's own
    errors do. An exit 1 after a job raised stays 1 (Hydra printed the job's error).
    """
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if code == 1 and not _job_raised and type(stop) is SystemExit:
            code = EXIT_CONFIG_ERROR
        if type(stop).__name__ == "SIGTERMException":  # Lightning's, a SystemExit(None): not a finished run
            code = EXIT_SIGTERM
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        traceback.print_exc()
        code = 1
    from parallelkit.launch import local_ranks

    if code and local_ranks.is_started_rank() and not local_ranks.joined():
        # A rank started by rank 0 that failed before the process group formed (a command line that does not
        # compose, bad input): rank 0 finds the same and says it; this rank's own words matter only if rank 0 goes on.
        local_ranks.defer_to_rank0()
        local_ranks.composed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
