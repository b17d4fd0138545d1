"""Parameter-server training: sparse tables on server ranks, dense layers all-reduced among workers.

The job's last ``servers`` ranks are parameter servers, the others workers (rank 0 stays a worker, so
it writes the summary, logs and checkpoints as in every other strategy). Inside Lightning's
``trainer.fit``:

- every rank joins the default process group and, while all ranks are still in step, creates the
  workers' group and starts its RPC agent;
- a server's :meth:`setup` serves requests until every worker reported done, shuts RPC down, and then
  sets ``limit_train_batches = 0``: its fit loop runs no batch and no hook (nothing to log or save);
- a worker's :meth:`setup` swaps the model's tables (named by its ``parameter_server_tables`` plan,
  :mod:`parallelkit.models.plans`) for :class:`~parallelkit.ps.ShardedEmbedding`; each step pulls the rows
  it needs, runs forward and backward, all-reduces the dense gradients among workers and pushes the
  sparse ones (or, in geo mode, trains a local copy and pushes deltas every ``geo_k_steps``);
- every collective Lightning issues (barrier, broadcast, reduce, all_gather) goes to the workers'
  group on workers and is a no-op on servers, which would otherwise deadlock against a serving rank.

The per-row optimizer of the tables is the run's optimizer (``optim=...``): SGD (no momentum), Adagrad,
or Adam/AdamW (lazy, per row); the current learning rate travels with every push, so schedules apply.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD, MIXED_PRECISION, SERVER_TABLES
from parallelkit.distributed.collectives import gather_stacked
from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S, init_process_group_for_attempt
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans, parallel_model
from parallelkit.ps import server as ps_server
from parallelkit.ps.client import PS, PSClient
from parallelkit.ps.embedding import ShardedEmbedding, apply_parameter_server
from parallelkit.ps.roles import PSDims, init_rpc, rpc_name
from parallelkit.ps.table import table_optimizer
from parallelkit.run_dir import checkpoint_step
from parallelkit.strategies.base import METRICS, model_state_bytes
from parallelkit.strategies.ddp import DDPStrategy

GRAD_ALLREDUCE = "grad_allreduce"


class ParameterServerStrategy(DDPStrategy):
    """Workers pull and push sparse rows to server ranks over RPC; dense gradients are all-reduced among workers.

    Args:
        servers: server ranks (the last ones of the job); the others are workers.
        mode: ``sync`` (equals single-process training), ``async`` (no waiting), ``geo`` (local training,
            deltas every ``geo_k_steps``). PaddlePaddle Fleet's three parameter-server modes.
        geo_k_steps: geo mode: local steps between two pushes of deltas.
        timeout_s: collective, RPC and server idle timeout in seconds.
        rpc_threads: request threads per RPC agent.
        listen_interface: network interface of the RPC agents (default: loopback for a one-host job).
        rpc_transports / rpc_channels: TensorPipe's transports and tensor channels (``None``: its choice; on one
            host that is shared memory, which no socket sees); ``["uv"]`` / ``["basic"]``: TCP, as between hosts.
        plan: where the model's table plan is (``mypkg.parallelize``); ``None``: the model's own methods, then
            the ``parallelize`` module beside its class.
        process_group_backend: ``gloo``/``nccl`` for the workers' all-reduce; default from the device.

    Example::

        Trainer(strategy=ParameterServerStrategy(servers=1, mode="async"), devices=3, accelerator="cpu")
    """

    strategy_name = "ps"
    capabilities = frozenset({LIGHTNING_BACKWARD, MIXED_PRECISION, SERVER_TABLES})

    def __init__(self, servers: int = 1, mode: str = "sync", geo_k_steps: int = 10, timeout_s: float = DEFAULT_TIMEOUT_S, rpc_threads: int = 16,
                 listen_interface: str | None = None, plan: str | None = None, process_group_backend: str | None = None,
                 rpc_transports: list[str] | None = None, rpc_channels: list[str] | None = None) -> None:
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise ConfigError(f"strategy.servers should be an int greater than 0. Got {servers!r}.")
        if mode not in ps_server.MODES:
            raise ConfigError(f"strategy.mode should be one of {', '.join(ps_server.MODES)}. Got {mode!r}.")
        if not isinstance(geo_k_steps, int) or isinstance(geo_k_steps, bool) or geo_k_steps < 1:
            raise ConfigError(f"strategy.geo_k_steps should be an int greater than 0 (local steps between pushes). Got {geo_k_steps!r}.")
        super().__init__(timeout_s=timeout_s, process_group_backend=process_group_backend)
        self.servers = servers
        self.mode = mode
        self.geo_k_steps = geo_k_steps
        self.rpc_threads = rpc_threads
        self.listen_interface = listen_interface
        self.rpc_transports = list(rpc_transports) if rpc_transports else None
        self.rpc_channels = list(rpc_channels) if rpc_channels else None
        self.plan_source = plan
        self.client: PSClient | None = None
        self._sharded: dict[str, ShardedEmbedding] = {}
        self._worker_group: Any = None
        self._failure: str | None = None

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def default_devices(self, accelerator: str) -> int:
        return self.servers + 1

    @override
    def _requested_dims(self, world_size: int) -> PSDims:
        if self.servers >= world_size:
            raise ConfigError(
                f"strategy.servers={self.servers} leaves no worker among {world_size} process(es) (trainer.devices × "
                f"trainer.num_nodes): start at least {self.servers + 1}, e.g. trainer.devices={self.servers + 2} for 2 workers."
            )
        return PSDims(world_size=world_size, dp=world_size - self.servers, servers=self.servers)

    @override
    def bind_trainer_config(self, trainer_cfg: dict[str, Any]) -> None:
        if trainer_cfg.get("gradient_clip_val"):
            raise ConfigError("strategy=ps does not clip gradients: the sparse ones are on the servers. Set trainer.gradient_clip_val=null.")

    @override
    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        model_plans(model, self.plan_source).require("parameter_server_tables", "strategy=ps")

    @override
    def check_lightning_module(self, module: Any) -> None:
        """The servers' per-row optimizer is built from the run's optimizer factory (``optim=``), which only
        parallelkit's ``TrainModule`` carries; a LightningModule's own ``configure_optimizers`` cannot tell it."""
        if not callable(getattr(module, "optimizer_factory", None)):
            raise ConfigError(
                f"strategy=ps cannot train {type(module).__name__} directly: the servers update their rows with the run's "
                "optimizer (optim=...: SGD, Adagrad or Adam, per row), which a LightningModule's own configure_optimizers "
                "does not describe. Give the model as an nn.Module (model._target_=mypkg.Net) with forward, loss and its "
                "parameter_server_tables plan; parallelkit wraps it with optim=."
            )

    @override
    def check_checkpoint(self, path: Any, shapes: dict[str, Any]) -> None:
        """A checkpoint resumes only with the servers' snapshot of its step beside it, written by as many servers as now."""
        path = Path(path)
        snapshot = snapshot_dir(path)
        step = checkpoint_step(path) if path.is_file() else None
        found = sorted(snapshot.glob(f"server*-step{step}.pt")) if snapshot.is_dir() and step is not None else []
        if not found:
            problem = (
                f"{path} is missing" if not path.is_file()
                else f"{path} is not a readable checkpoint" if step is None
                else f"{snapshot} holds no snapshot of step {step}"
            )
            raise ConfigError(
                f"strategy=ps resumes from a checkpoint file with the servers' table snapshot of the same step beside it "
                f"({ps_server.snapshot_file(snapshot, 'K', step if step is not None else 'N')}); {problem}. "
                "Pass a checkpoint this strategy wrote, or drop ckpt_path."
            )
        servers = {int(f.name.split("-")[0].removeprefix("server")) for f in found}
        if servers != set(range(self.servers)):
            advice = (
                f"Resume with strategy.servers={len(servers)}." if servers == set(range(len(servers)))
                else "The snapshot is incomplete: resume from an earlier checkpoint."
            )
            raise ConfigError(
                f"{snapshot} holds the step-{step} tables of server(s) {sorted(servers)}, but strategy.servers={self.servers}: rows are "
                f"hash-partitioned by the number of servers. {advice}"
            )

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The checkpoint's model state has no dense table (the servers hold it): load it into the swapped model.
        return True

    @property
    def is_server(self) -> bool:
        return self.parallel_dims.is_server(self.global_rank)

    # ---------------------------------------------------------------- process groups and RPC
    @override
    def setup_distributed(self) -> None:
        init_process_group_for_attempt(self._get_process_group_backend(), self._timeout, self)  # torchrun restarts; listeners on MASTER_ADDR
        LightningDDPStrategy.setup_distributed(self)
        self._parallel_dims = dims = self.plan(self.world_size)
        # Every rank takes part in creating every group, now, while all ranks are still in step.
        self._worker_group = dist.new_group(list(range(dims.workers)), timeout=self._timeout)
        if dims.is_server(self.global_rank):  # before the RPC agent: a request may arrive as soon as it runs
            ps_server.start_server(dims.workers, self.mode, wait_timeout_s=self.timeout_s)
        # The agents meet on the default group's store (per attempt under torchrun): no port to pick, and a
        # restarted attempt cannot meet the dead attempt's agents.
        init_rpc(self.global_rank, self.world_size, None, self.rpc_threads, self.timeout_s, self.listen_interface, local=self.num_nodes == 1,
                 transports=self.rpc_transports, channels=self.rpc_channels)

    @property
    @override
    def data_parallel_group(self) -> Any:
        return self._worker_group

    # ---------------------------------------------------------------- setup: serve, or swap the tables
    @override
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.check_lightning_module(module)
        tables = model_plans(module, self.plan_source).parameter_server_tables(table_optimizer(module.optimizer_factory))
        if self.is_server:
            apply_parameter_server(parallel_model(module), tables)  # drop this copy's dense table: servers hold rows only
            self._serve()
            trainer.limit_train_batches = 0  # the fit loop on a server runs nothing
            trainer.num_sanity_val_steps = 0
            return
        dims = self.parallel_dims
        servers = [rpc_name(r) for r in dims.server_ranks()]
        self.client = PSClient(
            servers, self.global_rank, dims.workers, self.mode, self.geo_k_steps, self.comm_stats, round_barrier=self._geo_round_barrier
        )
        self._sharded = apply_parameter_server(parallel_model(module), tables, self.client)
        for spec in tables.values():
            self.client.create_table(spec)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"strategy=ps trains with one optimizer (the tables use its kind and learning rate); the module configured {len(self.optimizers)}."
            )
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)
        self._route_sigterm_broadcast(trainer)

    @override
    def on_train_start(self) -> None:
        # Lightning restores a checkpoint after setup (restore_checkpoint_after_setup): only now is its path known.
        ckpt_path = self.lightning_module.trainer.ckpt_path
        if self.client is not None and ckpt_path:
            self._restore_tables(str(ckpt_path))
        super().on_train_start()

    def _restore_tables(self, ckpt_path: str) -> None:
        """Rank 0 has the servers load the snapshot of the checkpoint's step; every worker goes on from that step."""
        step = self.lightning_module.trainer.global_step  # restored from the checkpoint by now
        if self.global_rank == 0:
            versions = self.client.restore(str(snapshot_dir(Path(ckpt_path))), step)
            if self.mode == "sync" and any(v != step for per_server in versions for v in per_server.values()):
                raise RuntimeError(f"the servers' snapshot beside {ckpt_path} holds table versions {versions}, the checkpoint step {step}")
        dist.barrier(group=self._worker_group)  # nobody pulls before the rows are back
        self.client.start_at(step)

    def _route_sigterm_broadcast(self, trainer: Any) -> None:
        """Lightning's training loop broadcasts a SIGTERM flag over the *default* group before every batch
        (``_broadcast_sigterm_tensor``, not through the strategy): against a serving rank that never joins,
        rank 0 blocks forever. On workers the same broadcast goes over the workers' group instead."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        loop = trainer.fit_loop.epoch_loop
        if not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
            raise RuntimeError(
                "strategy=ps relies on Lightning's training_epoch_loop._broadcast_sigterm_tensor (Lightning 2.6); this "
                "Lightning version has none: check which collectives its loop issues outside the strategy."
            )

        def broadcast_over_workers() -> None:
            flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
            dist.broadcast(flag, src=0, group=self._worker_group)
            if flag.item() == 1:
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = broadcast_over_workers

    def _serve(self) -> None:
        import torch.distributed.rpc as rpc

        server = ps_server.current()
        try:
            server.wait_until_done(idle_timeout_s=self.timeout_s)
        except BaseException:
            rpc.shutdown(graceful=False)
            raise
        rpc.shutdown(graceful=True)  # a barrier over all RPC ranks: the workers are shutting down too

    # ---------------------------------------------------------------- the step
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            result = closure()  # forward (pulls) and backward
            self._allreduce_dense_grads()
            grads = {m.spec.name: m.take_gradients() for m in self._sharded.values()}
            self.client.step(grads, lr=float(optimizer.param_groups[0]["lr"]))
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def _geo_round_barrier(self) -> None:
        with counting(self.comm_stats, PS):  # empty messages: counted as a collective, 0 payload bytes
            dist.barrier(group=self._worker_group)

    def _allreduce_dense_grads(self) -> None:
        workers = self.parallel_dims.workers
        params = [p for p in self.lightning_module.parameters() if p.grad is not None]
        if workers == 1 or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one fused collective per step
        with counting(self.comm_stats, GRAD_ALLREDUCE):
            dist.all_reduce(flat, group=self._worker_group)
        flat /= workers
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    # ---------------------------------------------------------------- collectives: workers only
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._worker_group is None:
            return super().barrier(*args, **kwargs)
        if not self.is_server:
            dist.barrier(group=self._worker_group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._worker_group is None or self.is_server:
            return obj if self._worker_group is not None else super().broadcast(obj, src)
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._worker_group)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._worker_group is None or not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, group, reduce_op)
        if self.is_server:
            return tensor
        with counting(self.comm_stats, METRICS):  # as the base class counts it: a barrier, then an all-reduce
            return _sync_ddp_if_available(tensor, group or self._worker_group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if self._worker_group is None:
            return super().all_gather(tensor, group, sync_grads)
        if self.is_server:
            return tensor.unsqueeze(0)
        if sync_grads:
            return _all_gather_ddp_if_available(tensor, group=group or self._worker_group, sync_grads=True)
        return gather_stacked(tensor, group or self._worker_group)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._worker_group is None or self.is_server:
            return decision
        total = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(total == self.parallel_dims.workers) if all else bool(total)

    @property
    @override
    def report_group(self) -> Any:
        return self._worker_group  # servers take no part in the workers' collectives

    # ---------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """The servers' snapshot of the tables (``NAME_ps/server{k}-step{N}.pt``, written by the servers themselves),
        then the workers' checkpoint (dense layers, optimizer, loops) as usual, then older snapshots are dropped.

        In this order a job killed at any point leaves the checkpoint file (written atomically by Lightning)
        with the snapshot of its own step beside it: the old pair until the new checkpoint is complete.
        """
        directory = str(snapshot_dir(Path(filepath)))
        step = checkpoint.get("global_step", self.client.steps_done if self.client else 0)
        if self.client is not None and self.is_global_zero:
            self.client.snapshot(directory, step)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.client is not None and self.is_global_zero:
            self.client.drop_snapshots(directory, step)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning drops an old checkpoint (``save_top_k``): its snapshot goes with it."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(snapshot_dir(Path(filepath)), ignore_errors=True)

    # ---------------------------------------------------------------- reporting and teardown
    @override
    def model_state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.lightning_module, self.optimizers)  # the worker's dense part only

    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """Servers' rows and bytes, the rows the workers touched, and bytes per step against the formula."""
        metrics = super().summary_metrics(trainer)
        client = self.client
        if client is None:
            return metrics
        steps = max(client.steps_done - client.first_step, 1)  # the steps this process trained
        dim = max(spec.dim for spec in client.specs.values())
        expected = 2 * (8 + 4 * dim) * client.unique_ids_pulled / steps
        sent = self.comm_stats.bytes("ps") / steps
        measured = sent + client.bytes_received / steps  # the formula counts both directions of the worker's link
        touched: list[Any] = [None] * self.parallel_dims.workers
        dist.all_gather_object(touched, {n: sorted(ids) for n, ids in client.touched.items()}, group=self._worker_group)
        tables: dict[str, dict[str, int]] = {}
        for per_server in client.server_stats():
            for name, stats in per_server.items():
                entry = tables.setdefault(name, {"rows": 0, "row_bytes": 0, "allocated_bytes": 0})
                for key in entry:
                    entry[key] += stats[key]
        for name, entry in tables.items():
            entry["unique_ids_touched"] = len(set().union(*(t.get(name, []) for t in touched)))
        return {**metrics,
            "ps": {
                "mode": self.mode,
                "servers": self.parallel_dims.servers,
                "workers": self.parallel_dims.workers,
                "geo_k_steps": self.geo_k_steps if self.mode == "geo" else None,
                "bytes_per_step": measured,  # sent + received
                "sent_bytes_per_step": sent,  # = comm.by_kind.ps: ids out, pushes out
                "received_bytes_per_step": measured - sent,  # rows the servers sent back
                "formula_bytes_per_step": expected,
                "bytes_ratio": measured / expected if expected else None,
                "tables": tables,
                "server_peak_rss_bytes": max(client.server_peak_rss_bytes()),  # summary's peak_rss_bytes: workers
                # This worker's training pulls / pushes: rows moved per second of its time spent in them.
                "rows_pulled": client.rows_pulled,
                "rows_pushed": client.rows_pushed,
                "pull_s": client.pull_s,
                "push_s": client.push_s,
                "pull_rows_per_s": client.rows_pulled / client.pull_s if client.pull_s else None,
                "push_rows_per_s": client.rows_pushed / client.push_s if client.push_s else None,
            }
        }

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failure = f"{type(exception).__name__}: {exception}"

    @override
    def teardown(self) -> None:
        import torch.distributed.rpc as rpc

        if self.client is not None:
            client, self.client = self.client, None
            try:
                client.done(self._failure)
            finally:
                rpc.shutdown(graceful=self._failure is None)
        super().teardown()


def snapshot_dir(checkpoint: Path) -> Path:
    """Where the servers' snapshot of a checkpoint lives: ``NAME.ckpt`` → ``NAME_ps/``."""
    return checkpoint.with_name(checkpoint.name.removesuffix(".ckpt") + "_ps")

