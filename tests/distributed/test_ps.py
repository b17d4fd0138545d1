"""The parameter-server bridge on 4 real ranks: 2 workers and 2 servers, talking over torch RPC (TensorPipe).

The workers train a small CTR model (DLRM-style) whose embedding table lives on the servers, each on its
own half of every global batch, with the dense gradients averaged over a workers-only gloo group, in
sync mode, by hand (the loop :class:`~parallelkit.strategies.ps.ParameterServerStrategy` runs inside
Lightning). The run must equal one process training the same model with a dense ``nn.EmbeddingBag`` and
``torch.optim.Adagrad`` on the whole batch: losses, table rows and dense weights within rel. 1e-5.
One launch does everything (a launch costs seconds on 2 cores); each test examines one aspect.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallelkit.data.ctr import make_ctr
from parallelkit.models.ctr import CTRModel
from parallelkit.models.ctr.parallelize import parameter_server_tables

from .harness import run_ranks

WORLD, WORKERS = 4, 2
FIELDS, ROWS_PER_FIELD, DIM = 4, 500, 8
GLOBAL_BATCH, STEPS, LR, SEED = 32, 20, 0.1, 5
REL_TOL = 1e-5
BIG_IDS = 10**7  # the id space of the memory check


def _model() -> CTRModel:
    torch.manual_seed(SEED)
    return CTRModel(num_fields=FIELDS, num_rows=FIELDS * ROWS_PER_FIELD, embedding_dim=DIM, hidden=[16], init_scale=0.1, embedding_seed=SEED)


def _data():
    ids, labels, _ = make_ctr(GLOBAL_BATCH * STEPS, FIELDS, ROWS_PER_FIELD, 1.1, 2.0, seed=SEED)
    return ids.view(STEPS, GLOBAL_BATCH, FIELDS), labels.view(STEPS, GLOBAL_BATCH)


def _ps_job(rank: int, world: int, rpc_dir: str) -> dict:
    import torch.distributed.rpc as rpc

    from parallelkit.ps import PSClient, apply_parameter_server, init_rpc, rpc_name
    from parallelkit.ps import server as srv
    from parallelkit.ps.client import PS

    workers = dist.new_group(list(range(WORKERS)))  # every rank creates every group
    if rank >= WORKERS:  # before the RPC agent starts: requests may come as soon as it runs
        server = srv.start_server(WORKERS, "sync", wait_timeout_s=60)
    init_rpc(rank, world, f"file://{rpc_dir}/store", num_threads=8, timeout_s=60)
    if rank >= WORKERS:
        server.wait_until_done(idle_timeout_s=60)
        rpc.shutdown()
        return {"stats": server.stats()}

    client = PSClient([rpc_name(r) for r in range(WORKERS, world)], rank, WORKERS, "sync")
    model = _model()
    tables = parameter_server_tables(model, {"optimizer": "adagrad", "eps": 1e-10})
    sharded = apply_parameter_server(model, tables, client)
    for spec in tables.values():
        client.create_table(spec)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)  # the dense part only: the table is remote
    ids, labels = _data()
    local = slice(rank * GLOBAL_BATCH // WORKERS, (rank + 1) * GLOBAL_BATCH // WORKERS)  # this worker's half
    losses = []
    for step in range(STEPS):
        loss = model.loss(model(ids[step, local]), labels[step, local])
        optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(flat, group=workers)
        torch.nn.utils.vector_to_parameters(flat / WORKERS, [p.grad for p in model.parameters()])
        client.step({m.spec.name: m.take_gradients() for m in sharded.values()}, lr=LR)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=workers)
        losses.append(float(mean) / WORKERS)
    bytes_ps = client.comm_stats.bytes(PS) + client.bytes_received  # sent (ids, pushes) + received (rows)
    unique_pulled = client.unique_ids_pulled
    dist.barrier(group=workers)  # training is over on both workers: worker 0 may now probe the servers
    out = {"losses": losses, "bytes_ps": bytes_ps, "unique_pulled": unique_pulled, "touched": sorted(client.touched["embedding"])}
    if rank == 0:
        touched = torch.tensor(sorted(set(range(FIELDS * ROWS_PER_FIELD))), dtype=torch.int64)
        out["rows"] = client.pull("embedding", touched, kind="probe")  # reads do not create rows
        out["dense"] = [p.detach().clone() for p in model.parameters()]
        out["bad"] = _bad_requests(client)
        out["snapshot"] = _snapshot_round_trip(client, f"{rpc_dir}/snap")
        out["memory"] = _memory(client)
    dist.barrier(group=workers)
    client.done()
    rpc.shutdown()
    return out


def _bad_requests(client) -> dict:
    """Each malformed request must come back as an error reply; the server keeps serving."""
    import torch.distributed.rpc as rpc

    from parallelkit.ps import server as srv

    server = client.servers[0]
    requests = {
        "unknown_table": (srv.rpc_pull, ("nope", torch.tensor([1]), None)),
        "float_ids": (srv.rpc_pull, ("embedding", torch.tensor([1.5]), None)),
        "wrong_width": (srv.rpc_push_delta, ("embedding", torch.tensor([2]), torch.ones(1, DIM + 3))),
        "not_a_tensor": (srv.rpc_pull, ("embedding", [1, 2], None)),
    }
    errors = {}
    for name, (fn, args) in requests.items():
        try:
            rpc.rpc_sync(server, fn, args=args)
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the error reply is what we look at
            errors[name] = str(err)
    errors["still_serving"] = tuple(rpc.rpc_sync(server, srv.rpc_pull, args=("embedding", torch.tensor([2]), None, False)).shape)
    return errors


def _snapshot_round_trip(client, directory: str) -> dict:
    ids = torch.arange(FIELDS * ROWS_PER_FIELD)
    before_stats = client.server_stats()
    before = client.pull("embedding", ids, kind="probe")
    client.snapshot(directory)
    client.push_delta("embedding", ids, torch.ones(len(ids), DIM))  # every row changes (and the table grows)
    changed = client.pull("embedding", ids, kind="probe")
    client.restore(directory)
    return {"before": before, "changed": changed, "after": client.pull("embedding", ids, kind="probe"), "stats": [before_stats, client.server_stats()]}


def _memory(client) -> dict:
    """Touch the same number of distinct ids in a 10^5 and a 10^7 id space: rows and bytes must be equal."""
    from parallelkit.ps import TableSpec

    g = torch.Generator().manual_seed(0)
    result = {}
    for name, space in (("small", 10**5), ("big", BIG_IDS)):
        client.create_table(TableSpec(name, DIM, "adagrad"))
        ids = torch.randperm(space, generator=g)[:3000]
        for chunk in ids.split(1000):
            client.pull(name, torch.unique(chunk))  # a training pull: creates the rows
        stats = [s[name] for s in client.server_stats()]
        result[name] = {"ids": len(torch.unique(ids)), **{k: sum(s[k] for s in stats) for k in ("rows", "row_bytes", "allocated_bytes")}}
    return result


def _reference() -> dict:
    """One process, dense nn.EmbeddingBag with sparse gradients, torch.optim.Adagrad, the whole batch."""
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    ids, labels = _data()
    losses = []
    for step in range(STEPS):
        loss = model.loss(model(ids[step]), labels[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    dense = [p.detach().clone() for name, p in model.named_parameters() if not name.startswith("embedding")]
    return {"losses": losses, "rows": model.embedding.weight.detach().clone(), "dense": dense, "ids": ids}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps")
    (tmp / "rpc").mkdir()
    return run_ranks(_ps_job, WORLD, tmp, str(tmp / "rpc"), timeout_s=150)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _max_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _rel_to_scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the tensor's scale. Elementwise relative error is meaningless for
    the entries that happen to sit near 0: fp32 round-off of the summation order (per worker, then across
    workers, against one sum over the whole batch) is relative to the values being added, not to the result."""
    return float((got - want).abs().max() / want.abs().max())


def test_sync_mode_equals_single_process_training(job, reference):
    w0, w1 = job[0], job[1]
    assert w0["losses"] == w1["losses"]
    assert _max_rel(w0["losses"], reference["losses"]) <= REL_TOL
    assert _rel_to_scale(w0["rows"], reference["rows"]) <= REL_TOL
    for got, want in zip(w0["dense"], reference["dense"]):
        assert got.shape == want.shape
        assert _rel_to_scale(got, want) <= REL_TOL
    # The table trained: rows moved away from their initial values.
    assert (w0["rows"] - _model().embedding.weight.detach()).abs().max() > 1e-3


def test_each_worker_trained_on_its_own_data(job, reference):
    assert job[0]["touched"] != job[1]["touched"]
    # Negative control: a reference that trains on worker 0's half only is told apart by the same check.
    model, (ids, labels) = _model(), _data()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    half = []
    for step in range(STEPS):
        loss = model.loss(model(ids[step, : GLOBAL_BATCH // 2]), labels[step, : GLOBAL_BATCH // 2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        half.append(float(loss.detach()))
    assert _max_rel(job[0]["losses"], half) > 100 * REL_TOL


def test_bytes_per_step_follow_the_unique_ids_formula(job):
    for worker in job[:WORKERS]:
        formula = worker["unique_pulled"] * (8 + 4 * DIM) * 2  # Σ_steps U·(8 + 4·D)·2
        assert worker["bytes_ps"] > 0
        assert 0.99 <= worker["bytes_ps"] / formula <= 1.05
        # Deduplication matters: a batch has far fewer unique ids than ids.
        assert worker["unique_pulled"] < STEPS * GLOBAL_BATCH // WORKERS * FIELDS


def test_servers_hold_only_touched_rows_whatever_the_id_space(job):
    memory = job[0]["memory"]
    for name in ("small", "big"):
        assert memory[name]["rows"] == memory[name]["ids"] == 3000
        assert memory[name]["row_bytes"] == 3000 * DIM * 4 * 2  # values + the Adagrad accumulator
        # Allocated: the live rows plus ids and step counts (16 bytes a row), at most 2× for the doubling
        # growth of each server's store; nothing proportional to the id space (10^7 rows would be 640 MB).
        live = 3000 * (DIM * 4 * 2 + 16)
        assert live <= memory[name]["allocated_bytes"] <= 2 * live
    # The embedding table: exactly the ids the workers trained on, summed over both servers.
    touched = set(job[0]["touched"]) | set(job[1]["touched"])
    held = sum(job[r]["stats"]["embedding"]["rows"] for r in range(WORKERS, WORLD))
    before_snapshot_probe = job[0]["snapshot"]["stats"][0]
    assert sum(s["embedding"]["rows"] for s in before_snapshot_probe) == len(touched)
    assert held >= len(touched)  # the snapshot test then grew it on purpose


def test_bad_requests_get_error_replies_and_the_server_survives(job):
    bad = job[0]["bad"]
    assert "unknown table" in bad["unknown_table"]
    assert "int64" in bad["float_ids"] and "int64" in bad["not_a_tensor"]
    assert "width" in bad["wrong_width"]
    assert bad["still_serving"] == (1, DIM)


def test_snapshot_restore_round_trip(job):
    snap = job[0]["snapshot"]
    assert not torch.allclose(snap["changed"], snap["before"])  # the probe did change the rows
    assert torch.equal(snap["after"], snap["before"])
    before, after = snap["stats"]
    assert [s["embedding"]["rows"] for s in after] == [s["embedding"]["rows"] for s in before]


# ------------------------------------------------------------------------------------ a worker dies mid-push
# Not through run_ranks: here a rank must die (SIGKILL), which the harness rightly reports as a failure.
DYING_ROWS, DYING_LR = 1 << 19, 0.1  # a 36 MiB push (ids + 16-wide fp32 rows): long enough to be cut on the wire


def _dying_rpc(rank: int, store: str) -> None:
    import os

    import torch.distributed.rpc as rpc

    os.environ["TP_SOCKET_IFNAME"] = "lo"
    # The TCP transport (not shared memory): the push really crosses a socket that the kill closes.
    options = rpc.TensorPipeRpcBackendOptions(init_method=store, num_worker_threads=4, rpc_timeout=60, _transports=["uv"])
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)


def _dying_push_server(store: str, results, inspect) -> None:
    """``results``: this process's own pipe to the test (a queue shared with the worker could be left locked by its death)."""
    import faulthandler
    import io
    import os

    import torch.distributed.rpc as rpc

    from parallelkit.ps import server as srv

    torch.set_num_threads(1)
    server = srv.start_server(1, "async", wait_timeout_s=60)
    _dying_rpc(0, store)
    inspect.wait(120)  # the test sets it once the worker is dead
    faulthandler.dump_traceback_later(30, file=open(store.removeprefix("file://") + ".stacks", "w"))  # if it hangs: where
    with server._cond:
        state = server.tables["t"].state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    results.send_bytes(buffer.getvalue())
    rpc.shutdown(graceful=False)  # the peer is gone: no graceful shutdown possible
    os._exit(0)


def _dying_push_worker(store: str, results, delay: float | None, killed_after) -> None:
    import os
    import signal
    import threading
    import time

    import torch.distributed.rpc as rpc

    from parallelkit.ps import PSClient, TableSpec
    from parallelkit.ps import server as srv

    torch.set_num_threads(1)
    _dying_rpc(1, store)
    client = PSClient(["rank0"], 0, 1, "async")
    client.create_table(TableSpec("t", DIM, "adagrad"))
    ids = torch.arange(DYING_ROWS)
    for chunk in ids.split(1 << 16):
        client.pull("t", chunk)  # the rows exist before the push
    grads = torch.full((DYING_ROWS, DIM), 0.5)
    results.send("ready")
    start = time.perf_counter()

    def kill() -> None:
        time.sleep(delay)
        killed_after.value = time.perf_counter() - start  # shared memory: no feeder thread to flush
        os.kill(os.getpid(), signal.SIGKILL)

    if delay is not None:
        threading.Thread(target=kill, daemon=True).start()
    future = rpc.rpc_async("rank0", srv.rpc_push, args=("t", 0, 0, ids, grads, DYING_LR))
    future.wait()  # killed before, during or after the transfer
    killed_after.value = time.perf_counter() - start
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_push_cut_by_a_dying_worker_is_applied_whole_or_not_at_all(tmp_path):
    """A worker pushes 2^19 rows in one async request and is SIGKILLed 0–256 ms after sending began (or once the
    reply came): each time the server's table holds either none of the push or all of it, exactly, never a part.
    Which one depends on how far the bytes got; TensorPipe runs a handler only for a message that arrived whole,
    and the handler computes every new value before it stores any."""
    import io
    import multiprocessing

    from parallelkit.ps import TableShard, TableSpec

    reference = TableShard(TableSpec("t", DIM, "adagrad"))
    ids = torch.arange(DYING_ROWS)
    before = reference.pull(ids).clone()
    reference.apply(ids, torch.full((DYING_ROWS, DIM), 0.5), DYING_LR)
    after = reference.pull(ids)
    assert (after != before).all()  # the push changes every row: a partial one would show

    ctx = multiprocessing.get_context("forkserver")  # the harness's server, torch preloaded: no import per process
    ctx.set_forkserver_preload(["torch"])
    outcomes = []
    for i, delay in enumerate([0.0, 0.004, 0.016, 0.064, 0.256, None]):
        # Nothing the dying worker touches may hold a lock: its own pipe, a lock-free shared double.
        (from_server, to_test), (from_worker, worker_to_test) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
        inspect, killed_after = ctx.Event(), ctx.Value("d", -1.0, lock=False)
        store = f"file://{tmp_path}/store{i}"
        server = ctx.Process(target=_dying_push_server, args=(store, to_test, inspect))
        worker = ctx.Process(target=_dying_push_worker, args=(store, worker_to_test, delay, killed_after))
        server.start()
        worker.start()
        try:
            assert from_worker.poll(120) and from_worker.recv() == "ready"
            worker.join(60)
            assert worker.exitcode == -9, worker.exitcode
            inspect.set()
            assert from_server.poll(120), f"the server did not answer: {(tmp_path / f'store{i}.stacks').read_text()}"
            state = torch.load(io.BytesIO(from_server.recv_bytes()), weights_only=False)
            server.join(60)
        finally:
            for proc in (server, worker):
                if proc.is_alive():
                    proc.kill()
        order = torch.argsort(state["ids"])
        assert torch.equal(state["ids"][order], ids)
        rows, accumulator = state["weights"][order], state["state"][0][order]
        if torch.equal(rows, before):
            assert (accumulator == 0).all()
            outcomes.append(("none", delay, round(killed_after.value, 4)))
        else:
            assert torch.equal(rows, after), f"a partial push: {int((rows == after).all(1).sum())} of {DYING_ROWS} rows updated"
            assert (accumulator == 0.25).all()
            outcomes.append(("whole", delay, round(killed_after.value, 4)))
    print("outcomes (applied, kill delay, killed after s):", outcomes)
    assert outcomes[-1][0] == "whole"  # the reply came before the kill
