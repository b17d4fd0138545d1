"""Pipeline receives posted ahead (parallelkit.distributed.pipeline_recv_ahead), on 2 gloo ranks.

GPipe with a fast first stage (2 ms per micro-batch) and a slow second one (20 ms): rank 0 sends its 4
activations long before rank 1 computes them. On gloo a send completes only once its receive is posted: torch
posts each receive right before its forward, and GPipe waits for its sends before its backward, so rank 0 waited
~60 ms for its last send (rank 1's fourth forward). With parallelkit's hand-offs rank 1 has posted all its
receives before its first forward, and rank 0's sends complete at once. The
gradients must be the same either way, and equal to one process's (the tags keep every message in its buffer,
checked with interleaved 1F1B too, where activations and gradients of two stages share the pair of ranks).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_ranks

WIDTH, ROWS, MICROBATCHES = 32, 4, 4


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Stage(nn.Module):
    def __init__(self, seed: int, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed)) / WIDTH**0.5)
            self.lin.bias.zero_()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(torch.tanh(self.lin(x)), self.seconds)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g), torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g)


def _run(rank: int, world: int, schedule: str, recv_ahead: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from parallelkit.distributed.pipeline_parallel import apply_pp, stage_ids_for_rank

    # When each receive was posted (to compare with when the forward that needs it ran).
    posted: list[float] = []
    irecv = c10d.irecv

    def traced_irecv(*args, **kwargs):
        posted.append(time.perf_counter())
        return irecv(*args, **kwargs)

    dist.irecv = c10d.irecv = traced_irecv  # both names: P2POp accepts only the module's own irecv

    virtual = 2 if schedule == "interleaved_1f1b" else 1
    ids = stage_ids_for_rank(rank, world, virtual, schedule)
    stages = [Stage(seed=s, seconds=0.002 if rank == 0 else 0.02) for s in ids]
    pipe = apply_pp(stages, ids, world * virtual, dist.group.WORLD, microbatches=MICROBATCHES, schedule=schedule,
                    loss_fn=_loss, device=torch.device("cpu"), trace=True, recv_ahead=recv_ahead)
    x, y = _data()
    for _ in range(2):  # the first step also runs torch's shape inference
        for stage in stages:
            stage.zero_grad()
        posted.clear()
        dist.barrier()
        loss = pipe.train_step(x, y)
    events = pipe.stats.events[-1]
    send_waits = sum(e["end"] - e["start"] for e in events if e["kind"] == "wait" and "send" in e["label"])
    forwards = sorted(e["start"] for e in events if e["kind"] == "F")
    return {"ids": ids, "grads": {s: [p.grad.clone() for p in stage.parameters()] for s, stage in zip(ids, stages)},
            "loss": loss, "send_waits": send_waits, "posted": posted, "forwards": forwards}


def _reference(num_stages: int) -> tuple[dict, torch.Tensor]:
    stages = [Stage(seed=s, seconds=0.0) for s in range(num_stages)]
    x, y = _data()
    losses = []
    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        out = xm
        for stage in stages:
            out = stage(out)
        loss = _loss(out, ym) / MICROBATCHES
        loss.backward()
        losses.append(loss.detach() * MICROBATCHES)
    return {s: [p.grad for p in stage.parameters()] for s, stage in enumerate(stages)}, torch.stack(losses).mean()


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recv_ahead")
    return {ahead: run_ranks(_run, 2, tmp, "gpipe", ahead) for ahead in (True, False)}


def test_receives_posted_before_the_first_forward_and_sends_never_hold_the_schedule(gpipe):
    rank0, rank1 = gpipe[True]
    # rank 1 (the last stage: no gradients to receive) posted its 4 activation receives before computing
    assert len(rank1["posted"]) == MICROBATCHES and max(rank1["posted"]) < rank1["forwards"][0]
    assert rank0["send_waits"] < 0.005, rank0  # its sends found their receives posted


def test_negative_control_receives_posted_late_hold_the_sender(gpipe):
    rank0, rank1 = gpipe[False]
    # torch posts each receive right before its forward: the fourth after three 20 ms forwards
    assert len(rank1["posted"]) == MICROBATCHES and rank1["posted"][-1] > rank1["forwards"][2]
    assert rank0["send_waits"] > 0.045, rank0  # and rank 0 waits for its last send until then


@pytest.mark.parametrize("ahead", [True, False])
def test_gradients_match_one_process(gpipe, ahead):
    grads, loss = _reference(2)
    for result in gpipe[ahead]:
        for s in result["ids"]:
            for got, want in zip(result["grads"][s], grads[s]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gpipe[ahead][1]["loss"], loss, rtol=1e-5, atol=1e-6)


def test_interleaved_messages_land_in_their_own_buffers(tmp_path):
    results = run_ranks(_run, 2, tmp_path, "interleaved_1f1b", True)
    grads, loss = _reference(4)
    for result in results:
        for s in result["ids"]:
            for got, want in zip(result["grads"][s], grads[s]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1]["loss"], loss, rtol=1e-5, atol=1e-6)
