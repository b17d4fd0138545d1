"""torch's schedules label every action with ``record_function``; parallelkit keeps the labels only while a
profiler records (pipeline_measure.label_actions_only_under_a_profiler): each costs ~40 µs per action, which was
2 points of the interleaved schedule's bubble error in bench/pipeline.py.

On 2 gloo ranks, interleaved 1F1B (the runtime schedule: one label per compute, send and receive): under
``torch.profiler.profile`` every action of the step shows up as a ``PP:`` event; in the next step, without a
profiler, ``record_function`` is never entered. Negative control: with torch's own labelling left in place the
same counter sees one entry per action.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed.harness import run_ranks

WIDTH, MICROBATCHES = 16, 4


def _run(rank: int, world: int, gate: bool) -> dict:
    import torch.distributed as dist
    from torch.autograd.profiler import record_function
    from torch.distributed.pipelining import schedules

    import parallelkit.distributed.pipeline_parallel as pp_module
    from parallelkit.distributed.pipeline_parallel import apply_pp, stage_ids_for_rank

    if not gate:  # negative control: torch's labelling as torch ships it
        pp_module.label_actions_only_under_a_profiler = lambda: None
    entered = [0]
    enter = record_function.__enter__

    def counted_enter(self):
        entered[0] += 1
        return enter(self)

    record_function.__enter__ = counted_enter
    ids = stage_ids_for_rank(rank, world, 2, "interleaved_1f1b")
    stages = [nn.Linear(WIDTH, WIDTH) for _ in ids]
    pipe = apply_pp(stages, ids, world * 2, dist.group.WORLD, microbatches=MICROBATCHES, schedule="interleaved_1f1b",
                    loss_fn=lambda out, y: ((out - y) ** 2).mean(), device=torch.device("cpu"))
    x = torch.randn(MICROBATCHES * 2, WIDTH, generator=torch.Generator().manual_seed(0))
    pipe.train_step(x, torch.zeros_like(x))  # shape inference
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.train_step(x, torch.zeros_like(x))
    profiled = [e.name for e in prof.events() if e.name.startswith("PP:")]
    entered[0] = 0
    pipe.train_step(x, torch.zeros_like(x))
    return {"actions": len(pipe.schedule.pipeline_order_with_comms[rank]), "profiled": profiled,  # noqa: E501
            "entered_without_profiler": entered[0], "gated": getattr(schedules.record_function, "only_under_a_profiler", False)}


def test_labels_only_under_a_profiler(tmp_path):
    for result in run_ranks(_run, 2, tmp_path, True):
        assert result["gated"]
        assert result["actions"] > 2 * MICROBATCHES * 2  # computes, sends and receives of two stages
        assert len(result["profiled"]) == result["actions"], result  # every action labelled in the profile
        assert any(name.endswith("F0") for name in result["profiled"]), result["profiled"]
        assert result["entered_without_profiler"] == 0, result


def test_negative_control_torch_labels_every_action_always(tmp_path):
    for result in run_ranks(_run, 2, tmp_path, False):
        assert not result["gated"]
        assert result["entered_without_profiler"] >= result["actions"], result
