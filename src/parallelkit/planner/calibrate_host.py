"""The host side of ``--calibrate``: what a training step costs the CPU beyond the model's kernels, measured by training.

- **host time per step** (one process): ``python -m parallelkit`` with ``strategy=single`` on 16-wide GPTs of 8-token sequences
  (kernels of negligible work) for 30 steps, with 1 and 4 blocks and 1 and 2 micro-batches per step: their median
  step times solve ``T = step + a·microbatch + L·layer_step + L·a·layer`` (:func:`host_time_terms`).
- **host time of tensor parallelism, FSDP2 and pipelines** (:func:`extra_terms`): the same tiny GPTs
  (:data:`PARALLEL_POINTS`: 1 and 4 blocks per rank, 1 and 2 micro-batches) under ``strategy=hybrid4d`` with ``tp = g``,
  ``sharding = g`` or ``pp = g`` (``g`` stages of that many blocks, GPipe: it runs one micro-batch) on ``g`` processes; each rank's CPU
  seconds per step (process time, every thread: DTensor dispatch, autograd through it, the collectives' own CPU work —
  a rank waiting in a collective sleeps and costs none) minus the one-process step: the CPU seconds the mechanism adds
  per step, per micro-batch and per block and micro-batch. Where ranks outnumber cores (8 CPU ranks on 2) this is work the node's shared cores
  must do; the DTensor micro-benchmark (``dtensor_op_overhead``: a local elementwise add) misses most of it.
- **host time of data parallelism** (:func:`data_parallel_terms`): the workload's own GPT blocks (their gradient bytes
  decide it; a tiny GPT's would not) with 1 and 4 blocks and one sequence per rank, one process and under
  ``strategy=hybrid4d`` with ``dp = g`` on ``g`` processes, interleaved in :data:`DP_REPEATS` rounds; the median
  difference of the ranks' CPU seconds per step gives the per-step and per-block CPU the gradient all-reduce adds.
- **an optimizer step** (:func:`optimizer_element_time`): the workload's optimizer on tensors of one block's sizes, one
  process at a rank's threads: seconds per parameter element.
- **compute in a step** (:func:`compute_scale`, GPT workloads): ``strategy=single`` on the workload's own width,
  heads, sequence and per-rank micro-batch with 1 and 4 blocks; the per-block step time beyond the per-block host and
  optimizer time,
  against the cost model's compute of that block from the measured GEMMs and bandwidth: kernels inside a training step
  (cold caches, backward GEMMs at transposed layouts, eager element-wise work below the streaming bandwidth) against
  the same shapes timed alone in a hot loop.

Every run uses the threads a training rank of the planned world gets (``max(1, CPUs // world)``, Lightning's launcher
default) and ``os.cpu_count()`` of this machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError

#: The tiny GPTs ``--calibrate`` trains to measure host time: (blocks, micro-batches per step).
HOST_POINTS = ((1, 1), (4, 1), (1, 2), (4, 2))
#: The points of the tensor-parallel, FSDP2 and pipeline runs (a subset of :data:`HOST_POINTS`; blocks per rank).
PARALLEL_POINTS = ((1, 1), (4, 1), (1, 2))
TINY = ["model=gpt", "model.n_embd=16", "model.n_head=4", "data=chars", "data.seq_len=8"]
STEPS = 30
SCALE_REPEATS = 3  # pairs of runs behind compute_scale (block_step_time)
DP_REPEATS = 3  # rounds of one-process and dp = g runs behind dp_host_overhead (data_parallel_terms)


def _callback_spec(out: str) -> str:
    return f"+callbacks={{calibrate_cpu:{{_target_:parallelkit.callbacks.step_cpu.StepCpu,out:{out}}}}}"


def _train(overrides: list[str], devices: int, threads: int) -> tuple[float, float]:
    """(median wall seconds per step, median over steps of the ranks' mean CPU seconds per step) of a run of
    ``python -m parallelkit``."""
    with tempfile.TemporaryDirectory(prefix="pk_calibrate_step_") as run_dir:
        probe = Path(run_dir) / "cpu"
        # The installed entry point with its packaged configs, run in the scratch directory: a pip user has
        # no clone and no train.py, and the user's working directory must not be written to.
        command = [sys.executable, "-m", "parallelkit", *overrides, f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
                   "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                   "checkpoint.every_n_steps=0", "checkpoint.every_n_minutes=0", f"hydra.run.dir={run_dir}", _callback_spec(str(probe))]
        # this parallelkit, also where it is imported from a source tree rather than installed
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
        proc = subprocess.run(command, cwd=run_dir, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise ConfigError(f"--calibrate could not run `python -m parallelkit` to measure the host time per step:\n{proc.stderr[-1500:]}")
        wall = float(json.loads((Path(run_dir) / "summary.json").read_text())["step_time_s_median"])
        marks = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(devices)]
    skip = 5  # warm-up steps
    steps = min(len(m) for m in marks) - 1
    cpu = [statistics.fmean(m[i + 1][1] - m[i][1] for m in marks) for i in range(min(skip, steps - 1), steps)]
    return wall, statistics.median(cpu)


def host_time_terms(times: dict[tuple[int, int], float]) -> dict[str, float]:
    """The host time per step ``T(L, a) = step + a·microbatch + L·layer_step + L·a·layer`` solved from the four
    measured points :data:`HOST_POINTS` (``L`` blocks, ``a`` micro-batches), each term at least 0."""
    d1 = times[4, 1] - times[1, 1]  # 3·(layer_step + layer)
    d2 = times[4, 2] - times[1, 2]  # 3·(layer_step + 2·layer)
    layer = max(0.0, (d2 - d1) / 3)
    layer_step = max(0.0, d1 / 3 - layer)
    microbatch = max(0.0, times[1, 2] - times[1, 1] - layer)
    step = max(0.0, times[1, 1] - microbatch - layer_step - layer)
    return {"step_overhead": step, "microbatch_overhead": microbatch, "layer_step_overhead": layer_step, "layer_overhead": layer}


def extra_terms(single: dict[tuple[int, int], float], parallel: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """(per step, per micro-batch, per block and micro-batch) CPU seconds a mechanism adds: ``single`` and ``parallel``
    are CPU seconds per step at :data:`PARALLEL_POINTS` (blocks, micro-batches), one process and under the mechanism:
    ``extra(L, a) = step + a·microbatch + L·a·block`` (its per-block work per step folded into the per-block term);
    each term at least 0."""
    extra = {p: parallel[p] - single[p] for p in PARALLEL_POINTS}
    block = max(0.0, (extra[4, 1] - extra[1, 1]) / 3)
    microbatch = max(0.0, extra[1, 2] - extra[1, 1] - block)
    step = max(0.0, extra[1, 1] - microbatch - block)
    return step, microbatch, block


def host_overheads(world: int) -> dict[str, Any]:
    """This machine's host time per step (:func:`host_time_terms`) and, for every ``g`` of 2 and 4 dividing ``world``,
    the CPU seconds tensor parallelism, FSDP2 and a pipeline add (:func:`extra_terms`)."""
    threads = max(1, (os.cpu_count() or 1) // world)
    runs = {point: _train(["strategy=single", *TINY, f"model.n_layer={point[0]}",
                           f"data.global_batch_size={8 * point[1]}", f"trainer.accumulate_grad_batches={point[1]}"], 1, threads)
            for point in HOST_POINTS}
    out: dict[str, Any] = host_time_terms({p: wall for p, (wall, _) in runs.items()})
    single = {p: runs[p][1] for p in PARALLEL_POINTS}
    for axis in ("tp", "sharding", "pp"):
        for g in (2, 4):
            if world % g or g > world:
                continue
            cpu = {(blocks, a): _train(parallel_overrides(axis, g, blocks, a), g, threads)[1] for blocks, a in PARALLEL_POINTS}
            out.setdefault(f"{axis}_host_overhead", {})[g] = list(extra_terms(single, cpu))
    return out


def parallel_overrides(axis: str, g: int, blocks: int, microbatches: int) -> list[str]:
    """The tiny GPT under ``axis = g`` whose ranks each hold ``blocks`` blocks and run ``microbatches`` micro-batches of
    the one-process run's 8 sequences (a pipeline: ``g`` stages of ``blocks`` blocks; GPipe, which runs 1 micro-batch)."""
    degrees = {"dp": 1, "sharding": 1, "tp": 1, "pp": 1, axis: g}
    ranks = g if axis == "sharding" else 1  # sharding's ranks each read their own 8 sequences
    out = ["strategy=hybrid4d", *(f"strategy.{k}={v}" for k, v in degrees.items()), *TINY,
           f"data.global_batch_size={8 * microbatches * ranks}"]
    if axis == "pp":
        return [*out, f"model.n_layer={blocks * g}", f"strategy.microbatches={microbatches}", "strategy.schedule=gpipe"]
    return [*out, f"model.n_layer={blocks}", f"trainer.accumulate_grad_batches={microbatches}"]


def workload_blocks(w: Any) -> list[str]:
    """Overrides that train the workload's own GPT blocks (width, heads, sequence) on ``data=chars``; the tiny GPT for a
    workload of another family."""
    shape = w.shape
    if shape.family != "gpt":
        return list(TINY)
    return ["model=gpt", "data=chars", f"model.n_embd={shape.hidden}", f"model.n_head={shape.heads}", f"data.seq_len={w.seq_len}"]


def data_parallel_terms(w: Any, world: int, repeats: int = DP_REPEATS) -> dict[int, list[float]]:
    """``{g: [per step, 0, per block]}``: the CPU seconds a rank of ``strategy=hybrid4d`` with ``dp = g`` (the gradient
    all-reduce) spends per step beyond one process's step, for every ``g > 1`` dividing ``world``. Each round runs the
    one-process steps with 1 and 4 of the workload's blocks (:func:`workload_blocks`), then the ``dp = g`` runs of the
    same blocks, one sequence per rank; the median over rounds of each difference is kept. (Single runs of the same
    config moved 30-42 ms per step within minutes on this 2-CPU VM: a difference of runs far apart is that noise.)"""
    from parallelkit.planner.search import divisors

    threads = max(1, (os.cpu_count() or 1) // world)
    model = workload_blocks(w)
    groups = [g for g in divisors(world) if g > 1]
    extra: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        single = {blocks: _train(["strategy=single", *model, f"model.n_layer={blocks}", "data.global_batch_size=1"], 1, threads)[1]
                  for blocks in (1, 4)}
        for g in groups:
            for blocks in (1, 4):
                cpu = _train(dp_overrides(g, model, blocks), g, threads)[1]
                extra.setdefault((g, blocks), []).append(cpu - single[blocks])
    out = {}
    for g in groups:
        one, four = (statistics.median(extra[g, blocks]) for blocks in (1, 4))
        block = max(0.0, (four - one) / 3)
        out[g] = [max(0.0, one - block), 0.0, block]
    return out


def dp_overrides(g: int, model: list[str], blocks: int) -> list[str]:
    """``model`` with ``blocks`` blocks under ``strategy=hybrid4d`` with ``dp = g`` alone, one sequence per rank."""
    return ["strategy=hybrid4d", f"strategy.dp={g}", "strategy.sharding=1", "strategy.tp=1", "strategy.pp=1", "strategy.cp=1",
            "strategy.ep=1", *model, f"model.n_layer={blocks}", f"data.global_batch_size={g}"]


def optimizer_element_time(w: Any, threads: int, min_time: float = 0.3) -> float:
    """Seconds per parameter element of one step of the workload's optimizer (``w.optimizer`` with its configured
    arguments, ``w.optimizer_kwargs``) on ``shape.layer_tensors`` tensors holding one block's elements, this process
    at ``threads`` threads:
    the median of 5 timed rounds. PyTorch's CPU AdamW loops over the tensors (no fused or multi-tensor default
    there), several element-wise passes each: 4.4 ms for the 0.83 M parameters of ``model=gpt`` on this 2-CPU VM,
    where streaming its bytes once at the measured bandwidth takes 0.6 ms."""
    import importlib

    import torch

    shape = w.shape
    tensors = max(1, shape.layer_tensors)
    elements = max(shape.dense_layer, tensors)
    module, _, name = w.optimizer.rpartition(".")
    optimizer_class = getattr(importlib.import_module(module), name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = [torch.nn.Parameter(torch.randn(elements // tensors)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        # the configured arguments (an optimizer may require some); a workload built without a config: lr only
        optimizer = optimizer_class(params, **(dict(w.optimizer_kwargs) or {"lr": 1e-3}))
        optimizer.step()  # state allocated
        rounds = []
        for _ in range(5):
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < min_time / 5:
                optimizer.step()
                calls += 1
            rounds.append((time.perf_counter() - start) / calls)
    finally:
        torch.set_num_threads(before)
    return statistics.median(rounds) / (elements // tensors * tensors)


def block_step_time(model: list[str], threads: int, repeats: int = SCALE_REPEATS) -> float:
    """Wall seconds one more block adds to a one-process training step of ``model``: the median over ``repeats``
    interleaved pairs of runs with 1 and 4 blocks. (One pair gave 4.1 and 7.1 ms per block for the same workload
    a quarter of an hour apart on this 2-CPU VM: a run's median step moves with the machine, and the difference of
    two medians doubles that; pairs run back to back see the same machine.)"""
    per_block = []
    for _ in range(repeats):
        one, four = (_train([*model, f"model.n_layer={layers}"], 1, threads)[0] for layers in (1, 4))
        per_block.append((four - one) / 3)
    return statistics.median(per_block)


def compute_scale(w: Any, hw: Any, world: int) -> float:
    """Seconds a block's kernels take in a training step over the cost model's compute of that block (1.0 where not
    measured): ``strategy=single`` on the workload's GPT (its width, heads, sequence, per-rank micro-batch) with 1 and
    4 blocks (:func:`block_step_time`); the per-block step time less the per-block host time, over
    :meth:`CostModel.layer`'s compute. The per-block step time holds the block's optimizer step too: the profile's
    ``optimizer_element_time`` × the block's elements comes off (the cost model charges it per element held)."""
    from parallelkit.planner.cost_model import CostModel

    shape = w.shape
    if shape.family != "gpt" or w.precision.name != "fp32" or w.recompute != "none" or not w.global_batch:
        return 1.0
    b = max(1, w.global_batch // world)
    threads = max(1, (os.cpu_count() or 1) // world)
    model = ["strategy=single", "model=gpt", "data=chars", f"model.n_embd={shape.hidden}", f"model.n_head={shape.heads}",
             f"data.seq_len={w.seq_len}", f"data.global_batch_size={b}"]
    modelled = CostModel(w, hw).layer(b, 1, 1, False, False, False).total
    measured = (block_step_time(model, threads) - hw.layer_step_overhead - hw.layer_overhead
                - hw.optimizer_element_time * shape.dense_layer)
    return round(measured / modelled, 3) if modelled > 0 and measured > 0 else 1.0  # not measurable: unscaled
