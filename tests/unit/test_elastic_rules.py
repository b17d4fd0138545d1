"""What a torchrun attempt at another world size does (parallelkit.distributed.elastic): which degrees follow the
world size, which checkpoint it continues from, which store prefix its ranks agree on. No process group."""

from __future__ import annotations

import pytest

from parallelkit.distributed import elastic
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.errors import ConfigError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1"}


@pytest.fixture
def torchrun(monkeypatch):
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in (*TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_an_explicit_dp_follows_the_world_under_torchrun_and_the_other_degrees_stay(torchrun):
    request = ParallelDims.request(dp=2, tp=2)
    assert request.resolve(4).degrees == {"dp": 2, "sharding": 1, "cp": 1, "tp": 2, "pp": 1}  # fits: unchanged
    shrunk = request.resolve(2)  # hybrid4d dp2×tp2 lost an agent of 2 ranks
    assert (shrunk.dp, shrunk.tp, shrunk.world_size) == (1, 2, 2)
    grown = ParallelDims.request(dp=1, tp=2, pp=2).resolve(8)
    assert (grown.dp, grown.tp, grown.pp) == (2, 2, 2)
    assert ParallelDims.request(dp=-1, sharding=2).resolve(2).degrees["sharding"] == 2  # -1 already follows


def test_a_world_the_kept_degrees_cannot_divide_is_a_clear_error(torchrun):
    with pytest.raises(ConfigError, match=r"torchrun started 3 processes, but .*tp\(2\).* = 2 does not divide them.*re-derives only dp"):
        ParallelDims.request(dp=2, tp=2).resolve(3)


def test_outside_torchrun_an_explicit_dp_that_does_not_fit_stays_an_error(no_torchrun):
    """Negative control: the re-derivation is torchrun's only; a plain run keeps its strict check."""
    with pytest.raises(ConfigError, match="processes were started"):
        ParallelDims.request(dp=2, tp=2).resolve(2)


def test_which_checkpoint_an_attempt_continues_from(torchrun, tmp_path):
    assert elastic.elastic_ckpt_path(None, tmp_path) == "last"  # restarted (count 1)
    assert elastic.elastic_ckpt_path("x.ckpt", tmp_path) == "x.ckpt"  # the command line decides
    torchrun.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic.elastic_ckpt_path(None, tmp_path) is None  # a first start in an empty directory
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert elastic.elastic_ckpt_path(None, tmp_path) == "last"  # an agent that joined a running job


def test_outside_torchrun_nothing_is_resumed_by_itself(no_torchrun, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert elastic.elastic_ckpt_path(None, tmp_path) is None


def test_the_store_prefix_is_one_every_agent_agrees_on(torchrun):
    torchrun.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the store outlives the attempts: per attempt
    assert elastic.store_prefix() == "attempt_1"
    torchrun.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a fresh store per round: agents' counts may differ
    prefixes = set()
    for count in ("0", "2"):
        torchrun.setenv("TORCHELASTIC_RESTART_COUNT", count)
        prefixes.add(elastic.store_prefix())
    assert len(prefixes) == 1


def test_the_log_line_names_the_world_and_the_degrees(torchrun):
    dims = ParallelDims.request(dp=2, tp=2).resolve(2)
    line = elastic.attempt_line(dims, devices=2, num_nodes=1, ckpt_path="run/checkpoints/last.ckpt", requested_dp=2)
    assert "runs the job at 2 process(es) (1 node(s) × 2) with degrees dp=1 tp=2" in line
    assert "strategy.dp=2 does not fit 2 processes" in line and "from run/checkpoints/last.ckpt" in line
    torchrun.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic.attempt_line(ParallelDims.request().resolve(2), 2, 1, None) is None  # a plain first start
