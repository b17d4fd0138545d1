"""Pipeline receives posted ahead: a stage's activations and gradients arrive while it computes.

torch's schedules post a receive just before the compute that needs it. On gloo a send moves its data only once
the matching receive is posted (the receiver announces it is ready, then the sender's thread writes), so a
receive posted late costs a round trip and two thread wake-ups on every hand-off: measured between two
processes here, 64 KiB one way takes 64 µs at the median but 1.26 ms at the 90th percentile when the receive
comes after the send, and 79 / 90 µs when it was posted first; and a sender that waits for its send (GPipe
waits for all its forward sends before its backward) is held until its receiver gets there. On the quiet 2-core
machine the measured bubble moved only a little closer to (P−1)/(V·M+P−1) (bench/pipeline.py): the rest of
each hand-off (the schedule's code, the ``isend`` call, the transfer, the wake-up) remains.

Here, the first time a schedule asks a stage for its forward (backward) receives in a step, all of that step's
forward (backward) receives of the stage are posted at once, into the stage's own per-micro-batch buffers; the
schedule then gets no receive ops to post, and the stage's compute waits for its micro-batch's receive just
before it runs (timed as a wait, not as compute). Messages carry a tag per receiving stage and direction, so
receives posted early can only match the sends meant for them, whatever the order of the messages between two
ranks (an interleaved schedule sends activations and gradients of several stages over the same pair).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.distributed as dist

# Far above the tags torch uses on the pipeline group (0: the hand-offs and the shape inference).
TAG_BASE = 1 << 16


def hand_off_tag(receiving_stage: int, backward: bool) -> int:
    """The tag of the messages stage ``receiving_stage`` receives: activations (forward) or gradients."""
    return TAG_BASE + 2 * receiving_stage + int(backward)


def _tagged(ops: list[Any], tag: int) -> list[Any]:
    return [dist.P2POp(op.op, op.tensor, op.peer, op.group, tag) for op in ops]


class RecvAhead:
    """Receives posted ahead for this rank's stages (see the module docstring).

    Built before the stages' compute is instrumented (it replaces their send/receive op getters); then
    :meth:`wait_before_compute` wraps each stage's compute last, so that the wait stays outside the timed compute.
    ``begin_step`` / ``end_step`` bracket every schedule step (training or evaluation).
    """

    def __init__(self, stages: list[Any], microbatches: int, on_wait: Callable[[str, float, float], None]) -> None:
        self.microbatches, self.on_wait = microbatches, on_wait
        self._posted: dict[tuple[int, bool, int], list[Any]] = {}  # (stage, backward, micro-batch) → works
        self._started: set[tuple[int, bool]] = set()
        for stage in stages:
            self._wrap_hand_offs(stage)

    def begin_step(self) -> None:
        self._started.clear()

    def end_step(self) -> None:
        if self._posted:  # a schedule that did not compute every micro-batch it received: a hang or a mismatch later
            left = sorted(self._posted)
            self._posted.clear()
            raise RuntimeError(f"pipeline receives posted ahead were never used (stage, backward, micro-batch): {left}")

    # ------------------------------------------------------------------------------------------------
    def _post_all(self, stage: Any, backward: bool, get_ops: Callable[[int], list[Any]]) -> None:
        tag = hand_off_tag(stage.stage_index, backward)
        for mb in range(self.microbatches):
            ops = _tagged(get_ops(mb), tag)
            self._posted[(stage.stage_index, backward, mb)] = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]

    def _wait(self, stage: Any, backward: bool, mb: int) -> None:
        works = self._posted.pop((stage.stage_index, backward, mb), None)
        if not works:
            return
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.on_wait(f"{'bwd' if backward else 'fwd'}_recv[s{stage.stage_index}] mb{mb}", start, time.perf_counter())

    def _wrap_hand_offs(self, stage: Any) -> None:
        index = stage.stage_index
        get_fwd_recv, get_bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops
        get_fwd_send, get_bwd_send = stage.get_fwd_send_ops, stage.get_bwd_send_ops

        def recv_ops(backward: bool, get_ops: Callable[[int], list[Any]]) -> Callable[[int], list[Any]]:
            def ahead(mb: int) -> list[Any]:
                if (index, backward) not in self._started:
                    self._started.add((index, backward))
                    self._post_all(stage, backward, get_ops)
                return []  # posted already: the schedule has nothing left to post

            return ahead

        stage.get_fwd_recv_ops = recv_ops(False, get_fwd_recv)
        stage.get_bwd_recv_ops = recv_ops(True, get_bwd_recv)
        stage.get_fwd_send_ops = lambda mb: _tagged(get_fwd_send(mb), hand_off_tag(index + 1, False))
        stage.get_bwd_send_ops = lambda mb: _tagged(get_bwd_send(mb), hand_off_tag(index - 1, True))

    def wait_before_compute(self, stage: Any) -> None:
        """A micro-batch's forward (backward) first waits for its activations (gradients) to have arrived."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            self._wait(stage, False, mb)
            return forward(mb, *args, **kwargs)

        def backward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            self._wait(stage, True, mb)
            return backward(mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
