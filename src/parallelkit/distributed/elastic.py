"""Process-group start-up that survives torchrun restarts (``torchrun --max-restarts=N``).

When a worker dies, torchrun's agent kills the others and starts a new attempt of every worker, but the
rendezvous store (the agent's TCPStore, ``TORCHELASTIC_USE_AGENT_STORE``) outlives the attempt: a
restarted group reads the dead workers' keys (addresses, barrier counters) and times out or hangs — 3 of
10 restarts worked when measured here. Prefixing every key with the attempt number
(``TORCHELASTIC_RESTART_COUNT``) gives each attempt a clean namespace in the same store (8 of 8 worked).

The group's timeout is set here too, once for every strategy (``strategy.timeout_s``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

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


def init_process_group_for_attempt(backend: str, timeout: timedelta, strategy: Any = None) -> bool:
    """Under torchrun, initialise the default group on ``attempt_<n>/`` keys of the job's store.

    Returns False outside torchrun or if a group exists; Lightning then initialises it. Either way the
    group's listeners bind to the address the ranks use (:mod:`parallelkit.distributed.listeners`; outside
    torchrun from ``strategy``'s cluster environment).
    """
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
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world, timeout=timeout)
    return True
