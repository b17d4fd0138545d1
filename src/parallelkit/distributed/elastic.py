"""Process-group start-up that survives torchrun restarts (``torchrun --max-restarts=N``).

When a worker dies, torchrun's agent kills the others and starts a new attempt of every worker, but the
rendezvous store (the agent's TCPStore, ``TORCHELASTIC_USE_AGENT_STORE``) outlives the attempt: a
restarted group reads the dead workers' keys (addresses, barrier counters) and times out or hangs — 3 of
10 restarts worked when measured here. Prefixing every key with the attempt number
(``TORCHELASTIC_RESTART_COUNT``) gives each attempt a clean namespace in the same store (8 of 8 worked).

The group's timeout is set here too, once for every strategy (``strategy.timeout_s``).

Elastic shrink and grow (``torchrun --nnodes=MIN:MAX``, docs/elastic.md): when an agent is lost, or one joins,
torchrun starts a new attempt at another ``WORLD_SIZE``. This module decides what such an attempt does:

- it continues from the run directory's newest checkpoint (:func:`elastic_ckpt_path`) — also on an agent that
  joins a running job, whose own restart count is still 0;
- the data-parallel degree follows the world size; the other degrees (tp, pp, cp, sharding) stay as the command
  line set them (:func:`elastic_degrees`); a world they cannot divide is a clear error;
- one line says how the attempt runs (:func:`attempt_line`);
- the key prefix of the attempt's store is one all its ranks agree on (:func:`store_prefix`): agents count their
  restarts separately (membership changes do not count), so an agent that joined late has another count.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from parallelkit.distributed.listeners import bind_listeners, bind_strategy_listeners
from parallelkit.errors import ConfigError

# Every strategy's default: a dead rank makes the others fail after this long, not after torch's 30 minutes.
# conf/strategy/*.yaml repeat the value (a key the command line may set); tests/unit/test_configs.py keeps them equal.
DEFAULT_TIMEOUT_S = 180.0


def process_group_timeout(timeout_s: float) -> timedelta:
    """``strategy.timeout_s`` (collectives and rendezvous, in seconds) checked, as the group's timeout."""
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ConfigError(f"strategy.timeout_s should be a number of seconds greater than 0. Got {timeout_s!r}.")
    return timedelta(seconds=timeout_s)


def restart_count() -> int | None:
    """torchrun's attempt number (0 on the first start), or None outside torchrun."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def store_prefix() -> str:
    """The key prefix of this attempt in the workers' store.

    With torchrun's shared agent store (its default, ``TORCHELASTIC_USE_AGENT_STORE=True``) the store outlives
    the attempts: the prefix is the attempt number. Without it (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, what
    growing needs: docs/elastic.md) every rendezvous round gets a fresh store that global rank 0 hosts, so one
    constant prefix is right — and necessary: an agent that joined late counts its restarts from 0 while the
    others do not, and per-count prefixes would never meet.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"attempt_{restart_count() or 0}"
    return "elastic"


def elastic_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """``ckpt_path`` for this attempt: unset under torchrun, ``last`` when torchrun restarted the job (restart
    count > 0) or when the run directory already holds a checkpoint (this agent joined a running job: its
    own restart count is 0, the job's is not)."""
    if ckpt_path is not None or restart_count() is None:
        return ckpt_path
    if (restart_count() or 0) > 0 or (run_dir / "checkpoints" / "last.ckpt").exists():
        return "last"
    return None


def elastic_degrees(degrees: dict[str, int], world_size: int) -> dict[str, int]:
    """Under torchrun, an explicit data-parallel degree that does not fit ``world_size`` follows it.

    ``degrees`` are the requested ``dp, sharding, cp, tp, pp`` (``-1``: the remaining ranks). An elastic job
    that lost or gained an agent runs at another world size: ``dp`` becomes ``-1`` (re-derived as the world
    size ÷ the other degrees, which stay); a world the other degrees cannot divide is then a ConfigError that
    names them. Outside torchrun, or when the degrees fit, they are returned unchanged.
    """
    if restart_count() is None or degrees.get("dp", -1) == -1 or -1 in degrees.values():
        return degrees
    if math.prod(degrees.values()) == world_size:
        return degrees
    fixed = math.prod(v for k, v in degrees.items() if k != "dp")
    if world_size % fixed:
        others = " × ".join(f"{k}({v})" for k, v in degrees.items() if k != "dp")
        raise ConfigError(
            f"torchrun started {world_size} processes, but {others} = {fixed} does not divide them: an elastic job "
            f"keeps tp, pp, cp and sharding and re-derives only dp (strategy.dp={degrees['dp']} was set for "
            f"{math.prod(degrees.values())} processes). Give torchrun node sizes whose total is a multiple of {fixed}."
        )
    return {**degrees, "dp": -1}


def attempt_line(dims: Any, devices: int, num_nodes: int, ckpt_path: str | None, requested_dp: int | None = None) -> str | None:
    """One line for the log of a torchrun attempt that continues a job (a restart, a shrink, a grow) or whose
    ``strategy.dp`` was re-derived (:func:`elastic_degrees`): the world it runs at and its degrees. None for a
    plain first start, and outside torchrun."""
    attempt = restart_count()
    refit = requested_dp not in (None, -1, dims.dp)
    if attempt is None or (ckpt_path is None and not refit):
        return None
    degrees = " ".join(f"{k}={v}" for k, v in dims.as_dict().items() if v != 1 or k == "dp")
    why = (f" (strategy.dp={requested_dp} does not fit {dims.world_size} processes: dp follows the world size, the other "
           "degrees stay)") if refit else ""
    start = f"from {ckpt_path}" if ckpt_path is not None else "from step 0"
    return (f"parallelkit: elastic: torchrun attempt {attempt} runs the job at {dims.world_size} process(es) ({num_nodes} "
            f"node(s) × {devices}) with degrees {degrees}{why}, {start}; the global batch is kept (each data-parallel rank "
            "takes global_batch_size ÷ dp of it).")


def init_process_group_for_attempt(backend: str, timeout: timedelta, strategy: Any = None) -> bool:
    """Under torchrun, initialise the default group on :func:`store_prefix` keys of the job's store.

    Returns False outside torchrun or if a group exists; Lightning then initialises it. Either way the
    group's listeners bind to the address the ranks use (:mod:`parallelkit.distributed.listeners`; outside
    torchrun from ``strategy``'s cluster environment).
    """
    # Imported here, not at the top: the launcher resolves degrees (elastic_degrees) before it starts the other
    # ranks, and importing torch there (~1.5 s) delayed every other rank's start by as much (bench/phases.py).
    import torch.distributed as dist

    attempt = restart_count()
    if dist.is_initialized():
        return False
    if attempt is None:
        if strategy is not None:
            bind_strategy_listeners(strategy)
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # With the agent's store (torchrun's default) the agent hosts it; otherwise rank 0 does.
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    bind_listeners(addr, port, rank if hosts else -1, os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"])
    # multi_tenant: rank 0's server, if bind_listeners started it on the ranks' address, is shared, not bound again.
    store = dist.TCPStore(addr, port, world, is_master=hosts, timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend, store=dist.PrefixStore(store_prefix(), store), rank=rank, world_size=world, timeout=timeout)
    return True
