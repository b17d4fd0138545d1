"""Faults for the parameter-server restart tests, on server ranks (imported by train.py via PYTHONPATH, like
fault_injection.py, whose ``KillRank`` kills workers: a server's fit loop runs no batch, so no batch hook fires
there). A server serves inside the strategy's ``setup``; a callback's ``setup`` runs just before, on the same rank,
with the server already created."""

import os
import sys
import threading
import time

from lightning.pytorch.callbacks import Callback


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KillServer(Callback):
    """Exit server rank ``rank`` abruptly (no cleanup, like ``kill -9``) in torchrun attempt ``only_attempt``:
    once its tables have applied ``at_step`` sync steps, or, with ``during_snapshot``, while it writes its
    snapshot of step ``at_step``, after half of the file is on disk."""

    def __init__(self, rank: int, at_step: int, during_snapshot: bool = False, only_attempt: int = 0) -> None:
        self.rank = rank
        self.at_step = at_step
        self.during_snapshot = during_snapshot
        self.only_attempt = only_attempt

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank != self.rank or _attempt() != self.only_attempt:
            return
        import torch

        from parallelkit.ps import server as srv

        server = srv.current()
        if self.during_snapshot:
            real_save = torch.save

            def save(obj, f, *args, **kwargs):
                if isinstance(obj, dict) and obj.get("step") == self.at_step and "tables" in obj:
                    real_save(obj, f, *args, **kwargs)
                    f.truncate(f.tell() // 2)
                    f.flush()
                    self._die(f"while writing its snapshot of step {self.at_step} ({f.name})")
                return real_save(obj, f, *args, **kwargs)

            torch.save = save
            return

        def watch() -> None:
            while min(server.version.values(), default=0) < self.at_step:
                time.sleep(0.005)
            self._die(f"at step {self.at_step}")

        threading.Thread(target=watch, daemon=True).start()

    def _die(self, when: str) -> None:
        print(f"ps_faults: killing server rank {self.rank} {when}", file=sys.stderr, flush=True)
        os._exit(13)


def _forget_tables(step: int) -> None:
    """On a server (called over RPC): fresh, empty tables of the same specs, at sync version ``step``."""
    from parallelkit.ps import server as srv
    from parallelkit.ps.table import TableShard

    server = srv.current()
    with server._cond:
        server.tables = {name: TableShard(shard.spec) for name, shard in server.tables.items()}
        server.version = {name: step for name in server.tables}


class ForgetTables(Callback):
    """A deliberately broken restart (negative control): the workers resume from the checkpoint, but the servers
    do not load their snapshot; they go on from fresh rows and optimizer state (at the checkpoint's step)."""

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed as dist
        import torch.distributed.rpc as rpc

        strategy = trainer.strategy

        def forget(ckpt_path) -> None:
            step = trainer.global_step
            if trainer.global_rank == 0:
                for server in strategy.client.servers:
                    rpc.rpc_sync(server, _forget_tables, args=(step,))
            dist.barrier(group=strategy.data_parallel_group)
            strategy.client.start_at(step)

        strategy._restore_tables = forget
