"""Geo mode's sync round on 3 real ranks (2 workers, 1 server, torch RPC): every re-pull sees every worker's delta.

Both workers train the same row locally (different gradients), then sync; worker 1 is held back before its
push. With the round barrier the strategy passes (:meth:`ParameterServerStrategy._geo_round_barrier`),
worker 0's re-pull waits for it: both workers' copies equal the server's row, which holds the initial row
plus both deltas divided by the number of workers. Negative control: without the barrier worker 0 re-pulls
before worker 1 pushed and keeps a copy without worker 1's change (what made the end-to-end geo AUC depend on
which process the OS ran first: 0.27–1.11 % behind sync, now one value).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .harness import run_ranks

WORKERS, DIM, LR, ROW = 2, 4, 0.5, 7
HOLD_BACK_S = 1.0  # worker 1 pushes this long after worker 0 (far beyond an RPC round trip)


def _geo_job(rank: int, world: int, rpc_dir: str, with_barrier: bool) -> dict:
    import torch.distributed.rpc as rpc

    from parallelkit.ps import PSClient, init_rpc, rpc_name
    from parallelkit.ps import server as srv
    from parallelkit.ps.table import TableSpec

    workers = dist.new_group(list(range(WORKERS)))  # every rank creates every group
    if rank >= WORKERS:
        server = srv.start_server(WORKERS, "geo", wait_timeout_s=60)
    init_rpc(rank, world, f"file://{rpc_dir}/store", num_threads=4, timeout_s=60)
    if rank >= WORKERS:
        server.wait_until_done(idle_timeout_s=60)
        rpc.shutdown()
        return {}

    barrier = (lambda: dist.barrier(group=workers)) if with_barrier else None
    client = PSClient([rpc_name(WORKERS)], rank, WORKERS, "geo", geo_k_steps=1, round_barrier=barrier)
    spec = TableSpec("emb", DIM, optimizer="sgd", seed=3, init_scale=0.1)
    client.create_table(spec)
    ids = torch.tensor([ROW])
    initial = client.lookup("emb", ids).clone()  # pulled and cached (training rows join the local copy)
    dist.barrier(group=workers)  # both cached the row before anyone pushes
    grad = torch.full((1, DIM), float(rank + 1))  # worker 0: ones, worker 1: twos
    if rank == 1:
        time.sleep(HOLD_BACK_S)
    client.step({"emb": (ids, grad)}, lr=LR)  # geo_k_steps=1: trains the local copy, then syncs
    local_after_sync = client.lookup("emb", ids).clone()  # from the local copy (cached)
    dist.barrier(group=workers)  # both rounds are over: the server's row is final
    server_row = client.pull("emb", ids, kind="probe")
    dist.barrier(group=workers)
    client.done()
    rpc.shutdown()
    return {"initial": initial, "local": local_after_sync, "server": server_row, "pushed": client.rows_pushed}


def _run(tmp_path, with_barrier: bool) -> list[dict]:
    (tmp_path / "rpc").mkdir()
    return run_ranks(_geo_job, WORKERS + 1, tmp_path, str(tmp_path / "rpc"), with_barrier, timeout_s=120)


def _expected_server_row(initial: torch.Tensor) -> torch.Tensor:
    # Each worker's SGD delta is -LR·grad; the server adds delta / workers (Fleet's GeoCommunicator).
    deltas = [-LR * torch.full((1, DIM), float(w + 1)) for w in range(WORKERS)]
    return initial + sum(deltas) / WORKERS


def test_every_worker_re_pulls_every_workers_delta(tmp_path):
    w0, w1, _ = _run(tmp_path, with_barrier=True)
    assert torch.equal(w0["initial"], w1["initial"])
    assert w0["pushed"] == w1["pushed"] == 1  # the round really sent the row from both workers
    expected = _expected_server_row(w0["initial"])
    assert torch.allclose(w0["server"], expected, rtol=0, atol=1e-6)
    # Worker 0 synced first, yet its copy holds worker 1's change too: the round's outcome is scheduling-free.
    assert torch.equal(w0["local"], w0["server"]) and torch.equal(w1["local"], w1["server"])


def test_without_the_round_barrier_the_first_worker_misses_the_other_delta(tmp_path):
    w0, w1, _ = _run(tmp_path, with_barrier=False)
    expected = _expected_server_row(w0["initial"])
    assert torch.allclose(w0["server"], expected, rtol=0, atol=1e-6)  # the server got both
    assert torch.equal(w1["local"], w1["server"])  # the late worker saw both
    own_only = w0["initial"] - LR * torch.ones(1, DIM) / WORKERS
    assert torch.allclose(w0["local"], own_only, rtol=0, atol=1e-6)  # the early one only its own
    assert not torch.allclose(w0["local"], w0["server"], rtol=0, atol=1e-3)
