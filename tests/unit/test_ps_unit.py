"""The parameter-server pieces in one process: tables, per-row optimizers, the server's request handling,
the strategy's input checks, and the CTR data. No process group, no RPC (tests/distributed/test_ps.py and
tests/integration/test_ps_train.py run them for real)."""

from __future__ import annotations

import itertools

import pytest
import torch

from parallelkit.data.ctr import CTRDataModule, make_ctr, roc_auc
from parallelkit.errors import ConfigError
from parallelkit.ps.server import ParameterServer
from parallelkit.ps.table import TableShard, TableSpec, init_rows
from parallelkit.strategies.ps import ParameterServerStrategy, table_optimizer

DIM, ROWS = 4, 40


def _sparse_steps(seed: int, steps: int, all_rows: bool = False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.arange(ROWS) if all_rows else torch.unique(torch.randint(0, ROWS, (12,), generator=g))
        yield ids, torch.randn(len(ids), DIM, generator=g)


@pytest.mark.parametrize(
    "kind, make_torch",
    [
        ("sgd", lambda p: torch.optim.SGD([p], lr=0.3)),
        ("adagrad", lambda p: torch.optim.Adagrad([p], lr=0.3)),
        ("adam", lambda p: torch.optim.SparseAdam([p], lr=0.3)),  # every row every step: lazy Adam = SparseAdam
    ],
)
def test_per_row_optimizer_equals_torch_sparse_optimizer(kind, make_torch):
    spec = TableSpec("t", DIM, kind, seed=3, init_scale=0.1, eps=1e-8 if kind == "adam" else 1e-10)
    weight = torch.nn.Parameter(init_rows(3, "t", torch.arange(ROWS), DIM, 0.1))
    optimizer = make_torch(weight)
    shard = TableShard(spec)
    for ids, grad in _sparse_steps(0, 6, all_rows=kind == "adam"):
        weight.grad = torch.sparse_coo_tensor(ids[None], grad, (ROWS, DIM))
        optimizer.step()
        shard.apply(ids, grad, lr=0.3)
    torch.testing.assert_close(shard.pull(torch.arange(ROWS)), weight.detach(), rtol=1e-6, atol=1e-7)
    # Negative control: a different learning rate is caught by the same comparison.
    other = TableShard(spec)
    for ids, grad in _sparse_steps(0, 6, all_rows=kind == "adam"):
        other.apply(ids, grad, lr=0.25)
    assert not torch.allclose(other.pull(torch.arange(ROWS)), weight.detach(), rtol=1e-6, atol=1e-7)


def test_init_rows_is_a_function_of_seed_table_and_id_only():
    ids = torch.tensor([5, 0, 10**12, 2**62, 77])
    whole = init_rows(1, "t", ids, DIM, 0.5)
    one_by_one = torch.cat([init_rows(1, "t", ids[i : i + 1], DIM, 0.5) for i in range(len(ids))])
    assert torch.equal(whole, one_by_one)
    assert torch.equal(init_rows(1, "t", ids.flip(0), DIM, 0.5), whole.flip(0))
    assert whole.abs().max() <= 0.5 and whole.std() > 0.1
    assert not torch.equal(init_rows(2, "t", ids, DIM, 0.5), whole)
    assert not torch.equal(init_rows(1, "u", ids, DIM, 0.5), whole)
    # Hash partitioning over 1 or 3 servers gives every row the same value as the dense table.
    for servers in (1, 3):
        shards = [TableShard(TableSpec("t", DIM, seed=1, init_scale=0.5)) for _ in range(servers)]
        got = torch.stack([shards[int(i) % servers].pull(i.view(1))[0] for i in ids])
        assert torch.equal(got, whole)


def test_rows_are_created_on_first_touch_only():
    shard = TableShard(TableSpec("t", DIM, "adagrad"))
    shard.peek(torch.arange(100))
    assert shard.num_rows == 0  # reads outside training do not grow the table
    shard.pull(torch.tensor([10**15, 3, 3 + 10**9]))
    shard.pull(torch.tensor([3]))
    stats = shard.stats()
    assert stats["rows"] == 3 and stats["row_bytes"] == 3 * DIM * 4 * 2  # values + Adagrad accumulator
    assert stats["allocated_bytes"] <= 16 * (DIM * 4 * 2 + 16)  # the minimum capacity, not the id space


def test_snapshot_restore_round_trip_loses_nothing(tmp_path):
    server = ParameterServer(num_workers=1, mode="async")
    server.create_table(TableSpec("t", DIM, "adam").as_dict())
    for ids, grad in _sparse_steps(1, 4):
        server.push("t", 0, 0, ids, grad, lr=0.1)
    before = server.tables["t"].state_dict()
    server.snapshot(str(tmp_path / "s.pt"))
    server.push("t", 0, 0, torch.arange(ROWS), torch.ones(ROWS, DIM), lr=0.1)  # changes every row after the snapshot
    fresh = ParameterServer(num_workers=1, mode="async")
    for target in (server, fresh):
        target.restore(str(tmp_path / "s.pt"))
        after = target.tables["t"].state_dict()
        assert after["spec"] == before["spec"]
        for key in ("ids", "weights", "steps"):
            assert torch.equal(after[key], before[key]), key
        assert all(torch.equal(a, b) for a, b in zip(after["state"], before["state"]))
    # The restored server goes on serving.
    fresh.push("t", 0, 0, torch.tensor([1]), torch.ones(1, DIM), lr=0.1)


def test_bad_requests_raise_and_the_server_keeps_serving():
    server = ParameterServer(num_workers=1, mode="async")
    server.create_table(TableSpec("t", DIM).as_dict())
    with pytest.raises(KeyError, match="unknown table"):
        server.pull("nope", torch.tensor([1]), None)
    with pytest.raises(ValueError, match="int64"):
        server.pull("t", torch.tensor([1.0]), None)
    with pytest.raises(ValueError, match="1-D"):
        server.pull("t", torch.tensor([[1]]), None)
    with pytest.raises(ValueError, match="width"):
        server.push("t", 0, 0, torch.tensor([1]), torch.ones(1, DIM + 1), 0.1)
    with pytest.raises(ValueError, match="exists"):
        server.create_table(TableSpec("t", DIM + 1).as_dict())
    assert server.pull("t", torch.tensor([1]), None).shape == (1, DIM)
    assert server.stats()["t"]["rows"] == 1  # the failed requests left nothing behind


def test_sync_mode_applies_the_mean_once_all_workers_pushed():
    server = ParameterServer(num_workers=2, mode="sync", wait_timeout_s=0.2)
    server.create_table(TableSpec("t", DIM, "sgd").as_dict())
    start = server.pull("t", torch.tensor([1, 2]), 0)
    server.push("t", 0, 1, torch.tensor([2]), torch.full((1, DIM), 4.0), 0.5)
    with pytest.raises(TimeoutError):  # step 0 is not complete: nobody may read step 1's rows
        server.pull("t", torch.tensor([1]), 1)
    server.push("t", 0, 0, torch.tensor([1, 2]), torch.ones(2, DIM), 0.5)
    after = server.pull("t", torch.tensor([1, 2]), 1)
    expected = start - 0.5 * torch.stack([torch.full((DIM,), 0.5), torch.full((DIM,), 2.5)])
    torch.testing.assert_close(after, expected)
    with pytest.raises(ValueError, match="step"):
        server.push("t", 0, 0, torch.tensor([1]), torch.ones(1, DIM), 0.5)  # step 0 is over


@pytest.mark.parametrize(
    "kwargs, world, message",
    [
        ({"servers": 3}, 3, "no worker"),
        ({"servers": 0}, 3, "servers"),
        ({"mode": "semi"}, 3, "mode"),
        ({"geo_k_steps": 0}, 3, "geo_k_steps"),
    ],
)
def test_bad_strategy_settings_are_config_errors(kwargs, world, message):
    with pytest.raises(ConfigError, match=message):
        ParameterServerStrategy(**kwargs).plan(world)


def test_plan_has_workers_as_data_parallel_ranks():
    dims = ParameterServerStrategy(servers=2).plan(5)
    assert dims.data_parallel_size == 3 and dims.server_ranks() == [3, 4]
    assert [dims.is_server(r) for r in range(5)] == [False, False, False, True, True]


def test_model_without_tables_and_unsupported_optimizers_are_config_errors():
    from functools import partial

    from parallelkit.models.ctr import CTRModel
    from parallelkit.models.mlp import MLP

    strategy = ParameterServerStrategy()
    with pytest.raises(ConfigError, match="parameter_server_tables"):
        strategy.check_model(MLP(), 3)
    strategy.check_model(CTRModel(num_fields=2, num_rows=10), 3)
    with pytest.raises(ConfigError, match="momentum"):
        table_optimizer(partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    with pytest.raises(ConfigError, match="RMSprop"):
        table_optimizer(partial(torch.optim.RMSprop, lr=0.1))
    assert table_optimizer(partial(torch.optim.Adagrad, lr=0.1, eps=1e-8)) == {
        "optimizer": "adagrad",
        "eps": 1e-8,
        "initial_accumulator_value": 0.0,
        "weight_decay": 0.0,
    }


def test_ctr_data_is_deterministic_power_law_and_has_a_ceiling():
    ids, labels, prob = make_ctr(4000, 4, 10**7, 1.1, 2.0, seed=0)
    again, _, _ = make_ctr(4000, 4, 10**7, 1.1, 2.0, seed=0)
    assert torch.equal(ids, again)
    assert ((ids // 10**7) == torch.arange(4)).all()  # each field in its slice of the id space
    _, counts = torch.unique(ids[:, 0], return_counts=True)
    assert counts.max() > 100 and (counts == 1).sum() > 100  # a head of popular ids and a long tail
    assert 0.1 < labels.mean() < 0.6
    assert 0.75 < roc_auc(prob, labels) < 1.0
    dm = CTRDataModule(num_samples=512, num_fields=3, rows_per_field=50, val_samples=256, global_batch_size=64)
    dm.configure(2, 1)
    assert dm.model_kwargs() == {"num_fields": 3, "num_rows": 150}
    assert 0.5 < dm.bayes["bayes_auc"] <= 1.0


def test_roc_auc_equals_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=g).float()  # many ties
    labels = (torch.rand(40, generator=g) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos.tolist(), neg.tolist())]
    assert roc_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)


def test_resume_needs_the_servers_snapshot_of_the_checkpoint_step_from_as_many_servers(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    strategy = ParameterServerStrategy(servers=2)
    with pytest.raises(ConfigError, match="missing"):
        strategy.check_checkpoint(ckpt, {})
    ckpt.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        strategy.check_checkpoint(ckpt, {})
    torch.save({"global_step": 10}, ckpt)
    with pytest.raises(ConfigError, match="last_ps holds no snapshot of step 10"):
        strategy.check_checkpoint(ckpt, {})
    snapshots = tmp_path / "last_ps"
    snapshots.mkdir()
    for k in (0, 1):  # an older pair: the servers' snapshot of step 5 does not go with a step-10 checkpoint
        (snapshots / f"server{k}-step5.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no snapshot of step 10"):
        strategy.check_checkpoint(ckpt, {})
    (snapshots / "server0-step10.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="strategy.servers=1"):
        strategy.check_checkpoint(ckpt, {})
    (snapshots / "server1-step10.pt").write_bytes(b"x")
    strategy.check_checkpoint(ckpt, {})


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_a_push_that_fails_half_way_leaves_rows_and_optimizer_state_untouched(kind):
    """A push is applied whole or not at all. ``lr=None`` fails only after the new optimizer state is computed
    (the point where an update that stored as it went would already have written the accumulator / moments)."""
    server = ParameterServer(num_workers=1, mode="async")
    server.create_table(TableSpec("t", DIM, kind).as_dict())
    for ids, grad in _sparse_steps(2, 3):
        server.push("t", 0, 0, ids, grad, lr=0.1)
    before = server.tables["t"].state_dict()
    ids = torch.arange(ROWS)
    with pytest.raises(TypeError):
        server.push("t", 0, 0, ids, torch.ones(ROWS, DIM), lr=None)
    after = server.tables["t"].state_dict()
    for key in ("ids", "weights", "steps"):
        assert torch.equal(after[key], before[key]), key
    assert all(torch.equal(a, b) for a, b in zip(after["state"], before["state"]))
    server.push("t", 0, 0, ids, torch.ones(ROWS, DIM), lr=0.1)  # the lock was released: it keeps serving
    assert not torch.equal(server.tables["t"].state_dict()["weights"], before["weights"])


def test_a_snapshot_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A server dying while it writes a snapshot leaves the previous file as it was, never half a file."""
    import parallelkit.ps.server as srv

    server = ParameterServer(num_workers=1, mode="async")
    server.create_table(TableSpec("t", DIM, "adagrad").as_dict())
    server.push("t", 0, 0, torch.arange(5), torch.ones(5, DIM), lr=0.1)
    path = tmp_path / "server0-step1.pt"
    server.snapshot(str(path), step=1)
    written = path.read_bytes()
    server.push("t", 0, 0, torch.arange(10), torch.ones(10, DIM), lr=0.1)

    real_save = torch.save

    def dies_half_way(obj, f):
        real_save(obj, f)
        f.truncate(f.tell() // 2)
        raise SystemExit("killed while writing")

    monkeypatch.setattr(srv.torch, "save", dies_half_way)
    with pytest.raises(SystemExit):
        server.snapshot(str(path), step=1)
    monkeypatch.undo()
    assert path.read_bytes() == written
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the torn temp file, beside it
    fresh = ParameterServer(num_workers=1, mode="async")
    fresh.restore(str(path), step=1)
    assert fresh.tables["t"].num_rows == 5
    with pytest.raises(ValueError, match="holds step 1, the checkpoint is of step 2"):
        fresh.restore(str(path), step=2)
    # The next checkpoint's snapshot, then the older one and the torn temp file are dropped.
    server.snapshot(srv.snapshot_file(tmp_path, 0, 2), step=2)
    server.drop_snapshots(str(tmp_path), 0, keep_step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server0-step2.pt"]


def test_ctr_values_per_field_keeps_the_samples_whatever_the_id_space():
    """The benchmark's 10^5 vs 10^7 comparison: the same values, labels and duplicates per batch, only the ids
    spread over a 100× larger space (no collisions in either)."""
    small, labels, prob = make_ctr(3000, 4, 10**5, 1.1, 2.0, seed=3, values_per_field=10**5)
    big, labels_big, prob_big = make_ctr(3000, 4, 10**7, 1.1, 2.0, seed=3, values_per_field=10**5)
    assert torch.equal(labels, labels_big) and torch.equal(prob, prob_big)
    assert ((big // 10**7) == torch.arange(4)).all() and ((small // 10**5) == torch.arange(4)).all()
    assert big.max() > 10**5 * 4  # really spread over the larger space
    pairs = torch.unique(torch.stack([small.flatten(), big.flatten()]), dim=1).shape[1]
    assert pairs == len(torch.unique(small)) == len(torch.unique(big))  # one-to-one: the same duplicates
    for batch in small.split(128), big.split(128):
        assert [len(torch.unique(b)) for b in batch] == [len(torch.unique(b)) for b in small.split(128)]
    # Negative control: the default hashing (with collisions) does not keep the unique ids per batch.
    hashed_small, _, _ = make_ctr(3000, 4, 10**5, 1.1, 2.0, seed=3)
    hashed_big, _, _ = make_ctr(3000, 4, 10**7, 1.1, 2.0, seed=3)
    assert len(torch.unique(hashed_small)) != len(torch.unique(hashed_big))
    with pytest.raises(ConfigError, match="values_per_field"):
        CTRDataModule(rows_per_field=100, values_per_field=101)
