"""The communication callbacks continue exactly (issue 33): ``trainer.max_steps=6``, then the same command with
``trainer.max_steps=12 ckpt_path=last``, is the run that went straight to 12 steps, bit for bit (``train_loss`` of
every step and the final parameters), at 2 ranks, for ``callbacks=[dgc]``, ``[grad_compression]`` with
``method=powersgd``, and ``[local_sgd]`` (fixed and adaptive periods; ``k_steps=4``, so the checkpoint of step 6
falls mid-period and the 6-step run's end-of-run averaging must not leak into the continuation).

What each must carry over, per rank (``parallelkit.callbacks.replica_state`` gathers it to rank 0 at save time;
Lightning alone saves rank 0's state and loads it on every rank):

- DGC: the residuals and the momentum-correction buffers;
- PowerSGD: the error feedback (and its warm-start factors, step counter and random state, which are the same on
  every rank), laid out again for DDP's buckets, which are rebuilt after the first step of every run;
- Local SGD: each replica's parameters, optimizer state and running period loss, as they were before the 6-step
  run averaged them because it ended.

Negative control: the same 6-step checkpoint with the per-replica state removed continues differently. Another
number of ranks (2 → 1) cannot use the replicas' state: the run says what restarts in one line and finishes.
DiLoCo's resume tests are in test_diloco_train.py. Dropout is on; validation is off.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.test_extend_run import ARGS, FOLLOWS_MAX_STEPS, _run, _same_weights

TWO = ["strategy=ddp", "trainer.devices=2"]
CALLBACKS = {
    # 6 steps of warm-up over 75 % and 99 %: compressed from the first step, residuals large at the checkpoint
    "dgc": ["optim=sgd", "callbacks=[dgc]", "callbacks.dgc.rampup_steps=4", "callbacks.dgc.sparsity=[0.75,0.99]"],
    # plain all-reduce for 2 steps, then rank-1 PowerSGD with error feedback and warm start (the defaults)
    "powersgd": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd", "callbacks.grad_compression.start_iter=2"],
    "local_sgd": ["optim=sgd", "callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4"],
    "local_sgd_adaptive": ["optim=sgd", "callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4", "callbacks.local_sgd.adaptive=true"],
}
OWNER = {"dgc": "callbacks=[dgc]", "powersgd": "callbacks=[grad_compression]", "local_sgd": "callbacks=[local_sgd]",
         "local_sgd_adaptive": "callbacks=[local_sgd]"}
SAID = {"dgc": "the residuals and momenta restart from zero",
        "powersgd": "PowerSGD's error feedback restarts from zero",
        "local_sgd": "every rank continues from the mean of the 2 saved replicas' parameters",
        "local_sgd_adaptive": "every rank continues from the mean of the 2 saved replicas' parameters"}


def _args(name: str) -> list[str]:
    return [*ARGS, *FOLLOWS_MAX_STEPS, *CALLBACKS[name]]


def _drop_replicas(run_dir: Path, owner_class: str) -> None:
    """The negative control's checkpoint: the callback's per-replica state removed (as parallelkit wrote it before)."""
    path = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    keys = [k for k in checkpoint["callbacks"] if k.startswith(owner_class)]
    assert len(keys) == 1 and "replicas" in checkpoint["callbacks"][keys[0]], list(checkpoint["callbacks"])
    del checkpoint["callbacks"][keys[0]]["replicas"]
    torch.save(checkpoint, path)


CLASS = {"dgc": "DeepGradientCompression", "powersgd": "GradCompression", "local_sgd": "LocalSGDCallback",
         "local_sgd_adaptive": "LocalSGDCallback"}


def _exact_control_and_other_degree(name: str, tmp_path: Path, other_degree: bool) -> None:
    args = [*_args(name), *TWO]
    straight, _ = _run([*args, "trainer.max_steps=12"], tmp_path / "straight")
    first, _ = _run([*args, "trainer.max_steps=6"], tmp_path / "extended")
    assert first["steps"] == 6 and first["train_loss"] == straight["train_loss"][:6]
    shutil.copytree(tmp_path / "extended", tmp_path / "dropped")
    if other_degree:
        shutil.copytree(tmp_path / "extended", tmp_path / "one_rank")

    extended, stderr = _run([*args, "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "extended")
    assert extended["steps"] == 12
    assert extended["train_loss"] == straight["train_loss"], (extended["train_loss"], straight["train_loss"])
    assert _same_weights(tmp_path / "extended", tmp_path / "straight")
    assert "replicas, this run has" not in stderr and "holds no per-replica state" not in stderr

    # negative control: without the per-replica state (rank 0's, or none, on every rank) the continuation differs
    _drop_replicas(tmp_path / "dropped", CLASS[name])
    dropped, stderr = _run([*args, "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "dropped")
    said = [line for line in stderr.splitlines() if "holds no per-replica state" in line]
    assert len(said) == 1 and OWNER[name] in said[0], stderr[-3000:]
    assert dropped["train_loss"][:6] == straight["train_loss"][:6]
    assert dropped["train_loss"][6:] != straight["train_loss"][6:]
    assert not _same_weights(tmp_path / "dropped", tmp_path / "straight")

    if other_degree:  # 2 ranks → 1: one line (rank zero) says what restarts, and the run finishes
        one, stderr = _run([*_args(name), "strategy=ddp", "trainer.devices=1", "trainer.max_steps=12", "ckpt_path=last"],
                           tmp_path / "one_rank")
        said = [line for line in stderr.splitlines() if "the checkpoint holds 2 replicas, this run has 1" in line]
        assert len(said) == 1, stderr[-3000:]
        assert said[0].split("this run has 1: ")[1].startswith(SAID[name]) and OWNER[name] in said[0], said[0]
        assert one["steps"] == 12 and one["world_size"] == 1
        assert one["train_loss"][:6] == straight["train_loss"][:6]


@pytest.mark.parametrize("name", ["dgc", "powersgd", "local_sgd"])
def test_a_finished_run_taken_further_is_the_uninterrupted_run(name, tmp_path):
    _exact_control_and_other_degree(name, tmp_path, other_degree=name == "local_sgd")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgc", "powersgd", "local_sgd_adaptive"])
def test_more_callbacks_taken_further_and_on_another_number_of_ranks(name, tmp_path):
    _exact_control_and_other_degree(name, tmp_path, other_degree=True)


class _Bucket:
    """What PowerSGDLayout reads of DDP's GradBucket."""

    def __init__(self, index: int, params: list) -> None:
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list:
        return list(self._params)


def test_powersgd_state_follows_the_parameters_when_ddp_rebuilds_its_buckets():
    """No processes: DDP's first bucket layout (reverse parameter order) is rebuilt after the first step, which a
    resumed PowerSGD run compresses already (the integration test above meets it: the rebuilt order differs for
    this GPT). The error feedback and warm-start factors must follow each parameter, not the bucket position;
    control: the flat tensors kept as they were are in the wrong places."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from parallelkit.distributed.powersgd_state import PowerSGDLayout, _q_blocks

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(8, 6), (8,), (6, 8), (8, 6), (5, 7)]]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    number = {p: i + 1 for i, p in enumerate(params)}  # by identity (list.index would compare values)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.5)
    first, rebuilt = params[::-1], [params[i] for i in (1, 3, 0, 4, 2)]
    layout = PowerSGDLayout()
    layout.before_hook(state, _Bucket(0, first))
    # what torch's hook leaves after a step under the first layout: per parameter, known values
    error = {p: torch.randn(p.numel()) for p in params}
    blocks, _, q_size = _q_blocks(first, state)
    assert len(blocks) == 4  # the four matrices; the vector is sent uncompressed
    q_first = torch.zeros(q_size)
    for i, (offset, size) in blocks.items():
        q_first[offset : offset + size] = float(number[first[i]])
    state.error_dict[0] = torch.cat([error[p] for p in first])
    state.q_memory_dict[0], state.p_memory_dict[0] = q_first.clone(), torch.empty(1)

    saved = layout.state_by_param(state, names)  # the checkpoint's form: per parameter name
    assert set(saved["error"]) == set(names.values()) and len(saved["q"]) == 4

    layout.before_hook(state, _Bucket(0, rebuilt))  # DDP rebuilt its bucket: re-laid out in the new order
    assert torch.equal(state.error_dict[0], torch.cat([error[p] for p in rebuilt]))
    assert not torch.equal(state.error_dict[0], torch.cat([error[p] for p in first]))  # control: the order matters
    blocks_rebuilt, _, _ = _q_blocks(rebuilt, state)
    for i, (offset, size) in blocks_rebuilt.items():
        assert torch.all(state.q_memory_dict[0][offset : offset + size] == number[rebuilt[i]])
    assert not torch.equal(state.q_memory_dict[0], q_first)

    # and from the checkpoint into a fresh state, laid out for the first layout again
    fresh, again = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.5), PowerSGDLayout()
    again.load_by_param(fresh, saved, {n: p for p, n in names.items()})
    again.before_hook(fresh, _Bucket(0, first))
    assert torch.equal(fresh.error_dict[0], torch.cat([error[p] for p in first])) and torch.equal(fresh.q_memory_dict[0], q_first)


KILL = ["+callbacks.kill._target_=fault_injection.KillRank", "+callbacks.kill.rank=1", "+callbacks.kill.at_step=12"]


@pytest.mark.slow
@pytest.mark.parametrize("name, saving", [("local_sgd", []), ("dgc", ["checkpoint.async_save=true"])], ids=["local_sgd", "dgc-async_save"])
def test_a_killed_run_resumed_from_its_periodic_checkpoint_is_the_uninterrupted_run(name, saving, tmp_path):
    """Checkpoints every 5 steps, rank 1 killed after step 12, resumed from step 10 (mid-period for Local SGD:
    averagings after 4, 8, 12, 16, 20): the per-replica state of a periodic checkpoint, written by a background
    thread with ``async_save``, comes back as the end-of-run one does."""
    from tests.integration.test_extend_run import ENV
    from tests.integration.test_train import train

    args = [*_args(name), *TWO, *saving, "checkpoint.every_n_steps=5", "trainer.max_steps=20"]
    straight, _ = _run(args, tmp_path / "straight")
    run_dir = tmp_path / "resumed"
    killed = train([*args, *KILL, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert killed.returncode != 0 and "killing rank 1 at step 12" in killed.stderr, killed.stderr[-2000:]
    resumed, stderr = _run([*args, "ckpt_path=last"], run_dir)
    assert resumed["steps"] == 20 and resumed["train_loss"] == straight["train_loss"]
    assert _same_weights(run_dir, tmp_path / "straight")
    assert "replicas, this run has" not in stderr
