"""Who is a server and who a worker, and the RPC agent every rank of a parameter-server job starts.

Workers are the first ranks and servers the last ``S``, so global rank 0 (which writes the summary,
checkpoints and logs) is always a worker. Every rank of the job is an RPC peer named ``rank{r}``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from parallelkit.distributed.parallel_dims import DP, EP, PP, SHARDING, TP, ParallelDims
from parallelkit.errors import ConfigError


def rpc_name(rank: int) -> str:
    return f"rank{rank}"


@dataclass(frozen=True)
class PSDims(ParallelDims):
    """:class:`ParallelDims` of a parameter-server job: ``dp`` workers plus ``servers`` server ranks.

    The data-parallel size is the number of workers (each reads its own shard of the data); servers
    read no data.
    """

    servers: int = 1
    mesh_order: tuple[str, ...] = field(default=(PP, DP, SHARDING, TP))

    def __post_init__(self) -> None:
        if self.sharding != 1 or self.tp != 1 or self.pp != 1 or self.ep != 1:
            raise ConfigError("strategy=ps uses only data parallelism among workers (sharding = tp = pp = ep = 1).")
        if self.dp + self.servers != self.world_size or self.dp < 1 or self.servers < 1:
            raise ConfigError(
                f"strategy=ps: {self.dp} worker(s) + {self.servers} server(s) must make the {self.world_size} "
                "processes started (trainer.devices × trainer.num_nodes)."
            )

    @property
    def workers(self) -> int:
        return self.dp

    def is_server(self, rank: int) -> bool:
        return rank >= self.dp

    def server_ranks(self) -> list[int]:
        return list(range(self.dp, self.world_size))

    def data_parallel_rank(self, rank: int, coords: dict[str, int] | None = None) -> int:
        return rank if rank < self.dp else 0  # a server reads no data; 0 keeps the sampler valid

    def coordinates(self, rank: int) -> dict[str, int]:
        return {DP: self.data_parallel_rank(rank), SHARDING: 0, TP: 0, PP: 0, EP: 0}

    def build_mesh(self, device_type: str):
        raise NotImplementedError("strategy=ps has no device mesh: workers use a process group of their own")


def init_rpc(rank: int, world_size: int, init_method: str | None = None, num_threads: int = 16, timeout_s: float = 120.0, interface: str | None = None,
             local: bool | None = None, transports: list[str] | None = None, channels: list[str] | None = None) -> None:
    """Start this rank's TensorPipe RPC agent (servers and workers alike).

    Args:
        init_method: where the agents find each other: ``None`` (the strategy's choice) = the default
            process group's store, under a key prefix of its own; else a URL (``file://``, ``tcp://``).
            Under torchrun the default group's store is the agent's store with a per-attempt prefix
            (:func:`~parallelkit.distributed.elastic.init_process_group_for_attempt`): a restarted attempt
            never reads the dead attempt's addresses, and no port has to be picked (a ``tcp://`` URL would
            not work there at all: with torchrun's agent store every rank connects as a client and nobody
            hosts it).
        interface: the network interface TensorPipe listens on; default: loopback when every rank is on
            this host (``local``; unset: guessed from ``init_method``), else TensorPipe's choice.
        transports / channels: TensorPipe's transports and tensor channels, in order of preference; ``None``:
            TensorPipe's choice, which between processes of one host is shared memory (``shm`` transport, ``cma``
            channel: no bytes pass through a socket). ``["uv"]`` / ``["basic"]`` send everything over TCP, as
            between hosts, so the kernel sees each byte.
    """
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    if init_method is None:
        _register_default_store_rendezvous()
        init_method = f"{_DEFAULT_STORE}://"
        if not dist.is_initialized():
            raise RuntimeError("init_rpc(init_method=None) rendezvouses on the default process group's store: initialise the group first")
    if local is None:
        local = init_method.startswith("file://") or "127.0.0.1" in init_method or "localhost" in init_method
    if interface or (local and "TP_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo")):
        os.environ["TP_SOCKET_IFNAME"] = interface or "lo"
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=num_threads, rpc_timeout=timeout_s,
                                              _transports=list(transports) if transports else None,
                                              _channels=list(channels) if channels else None)
    rpc.init_rpc(rpc_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


_DEFAULT_STORE = "parallelkit-pg-store"


def _default_store_rendezvous(url: str, **kwargs):
    """A rendezvous handler (``torch.distributed.rendezvous``) that hands out the default group's store."""
    from urllib.parse import parse_qsl, urlparse

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    query = dict(parse_qsl(urlparse(url).query))
    # Our own prefix: RPC adds rpc_prefix_<n> below it; the default group's keys stay apart.
    yield dist.PrefixStore("parallelkit_rpc", _get_default_store()), int(query["rank"]), int(query["world_size"])


def _register_default_store_rendezvous() -> None:
    from torch.distributed.rendezvous import register_rendezvous_handler  # the module (torch.distributed.rendezvous is a function)

    try:
        register_rendezvous_handler(_DEFAULT_STORE, _default_store_rendezvous)
    except RuntimeError:  # registered already (a second fit in this process)
        pass
