"""``python -m parallelkit.plan --calibrate [overrides]``: measure this machine into a hardware profile.

Starts ``trainer.devices`` processes on the run's backend (gloo on CPU, NCCL on GPU), as a training job would,
and measures, writing every number into the profile:

- **matmul at the model's shapes**: rank 0 alone (the others wait) times every per-rank GEMM the cost model will
  ask for — the attention and MLP projections and the output layer for each tensor-parallel degree the model
  allows and each micro-batch size its batch allows, and the attention-score GEMMs — forward shapes, fp32 and
  (where the run uses it) bf16. The fastest large GEMM gives ``matmul_flops``; a large elementwise add gives
  ``memory_bandwidth``; a tiny op ``kernel_overhead``.
- **DTensor dispatch**: an elementwise op on DTensors of a mesh over every rank against the same op on plain
  tensors (rank 0 alone): what each operation of tensor parallelism and of FSDP2's sharded parameters costs extra.
- **compute units**: the same GEMM timed by one process alone, then the same number of them run by every rank at
  once between two barriers: their total at the one-process rate over that wall time is how many ranks' worth of
  compute the node really has (ranks that share cores share it).
- **host time** (:mod:`~parallelkit.planner.calibrate_host`): ``python -m parallelkit`` on tiny GPTs (kernels of negligible
  work), one process: the host seconds per step, micro-batch, block and step, block and micro-batch; under
  ``strategy=hybrid4d`` with ``tp = g``, ``sharding = g`` or ``pp = g`` on ``g`` processes: the CPU seconds per step,
  micro-batch and block tensor parallelism, FSDP2 and a pipeline add to a rank; with ``dp = g``, on the workload's own
  blocks, the CPU seconds per step and block the gradient all-reduce adds; the workload's optimizer step per
  parameter element; and ``compute_scale``, the workload's own GPT blocks in a one-process training step against the
  cost model's compute of them.
- **collectives per group size**: for every group size g dividing the world, all groups at once (as in training),
  all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point send/recv at several sizes, each the median
  of ``COLLECTIVE_PASSES`` rounds taken in passes through all of them (:func:`interleaved_medians`); a least-squares
  fit of ``time = latency + bytes sent / bandwidth`` per operation and g.

The profile (YAML) is what ``strategy.hardware=PATH`` loads; its ``sources`` say where, when and how it was measured.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError
from parallelkit.planner.calibrate_host import HOST_POINTS, compute_scale, data_parallel_terms, host_overheads, host_time_terms, optimizer_element_time  # noqa: F401
from parallelkit.planner.hardware import HOST_TERMS, PARALLEL_HOST_TERMS, Hardware, Link, host_memory_per_rank
from parallelkit.planner.search import divisors
from parallelkit.planner.workload import Workload

CONCURRENT_CALLS = 48  # 512³ GEMMs per rank in the all-at-once phase (~0.5 s at 8 ranks on 2 cores)
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20)  # bytes per collective buffer
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def gemm_shapes(w: Workload, world: int, max_shapes: int = 160) -> list[tuple[int, int, int]]:
    """Forward GEMM shapes ``(m, n, k)`` the cost model asks for on ``world`` ranks (see the module docstring)."""
    shape, s = w.shape, w.seq_len
    sizes = dict(shape.tp_sizes)
    tps = [t for t in divisors(world) if t == 1 or (not shape.tp_plan and all(v % t == 0 for v in sizes.values()))]
    batch = w.global_batch or (w.per_rank_batch or 1) * world
    micro = [b for b in divisors(batch) if b <= max(1, batch // 1)]
    h, a, kv, d, f, v = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn, shape.vocab
    out: set[tuple[int, int, int]] = set()
    for t in tps:
        for b in micro:
            rows = b * s
            out |= {(rows, (a + 2 * kv) * d // t, h), (rows, h, a * d // t), (rows, f // t, h), (rows, h, f // t), (rows, v // t, h)}
    out |= {(s, s, d), (s, d, s)}
    return sorted(out, key=lambda x: x[0] * x[1] * x[2])[:max_shapes]


def _timeit(fn: Any, min_time: float = 0.02, repeats: int = 3) -> float:
    """Seconds per call: the best of ``repeats`` runs of enough calls to last ``min_time``."""
    fn()
    calls, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or calls > 10_000:
            break
        calls *= 4
    best = elapsed / calls
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


COLLECTIVE_PASSES = 5  # timed passes over every (operation, group size, buffer size); the median per entry is kept


def _collective_round(fn: Any, nbytes: int) -> float:
    """Seconds per call of a collective, one timed round: a fixed number of calls on every rank (a collective must be
    called the same number of times by all members; a per-rank adaptive count would deadlock), more for small buffers."""
    import torch.distributed as dist

    calls = 20 if nbytes <= 64 * 2**10 else 6
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved_medians(jobs: list[tuple[Any, Any, int]], time_round: Any, passes: int = COLLECTIVE_PASSES) -> dict[Any, float]:
    """``{key: median seconds}`` over ``passes`` passes through every ``(key, fn, nbytes)`` job in turn. Interleaved, not
    each job's rounds back to back: on a shared machine a disturbance lasts seconds and would otherwise take every
    round of the few jobs it overlaps (one 8-rank calibration fitted an all-gather latency of 52 ms where the others
    measured 9-19); spread over passes, it costs each job at most the one round the median drops."""
    rounds: dict[Any, list[float]] = {key: [] for key, _, _ in jobs}
    for _, fn, _ in jobs:
        fn()  # warm-up: connections, buffers
    for _ in range(passes):
        for key, fn, nbytes in jobs:
            rounds[key].append(time_round(fn, nbytes))
    return {key: statistics.median(r) for key, r in rounds.items()}


def _worker(rank: int, world: int, store_dir: str, shapes: list[tuple[int, int, int]], dtypes: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    from parallelkit.distributed.collectives import all_gather_single, reduce_scatter_single  # torch's current names

    # The threads a training rank gets: Lightning's launchers set max(1, CPUs // processes) unless OMP_NUM_THREADS
    # says otherwise (lightning.fabric.utilities.distributed._set_num_threads_if_needed).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world)))
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    result: dict[str, Any] = {"threads_per_rank": torch.get_num_threads(), "cpus": os.cpu_count() or 1}
    torch.manual_seed(rank)

    def gemm_fn(m: int, n: int, k: int, dtype: Any):
        x, y = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        return lambda: torch.mm(x, y)

    big = gemm_fn(512, 512, 512, torch.float32)
    # Phase 1: rank 0 alone (the others wait in a barrier: gloo waits block, they leave the cores free).
    if rank == 0:
        table = {}
        for m, n, k in shapes:
            for name in dtypes:
                dtype = torch.float32 if name == "fp32" else torch.bfloat16
                table[f"{m},{n},{k},{name}"] = _timeit(gemm_fn(m, n, k, dtype), min_time=0.01, repeats=2)
        result["matmul_measured"] = table
        result["single_gemm_s"] = _timeit(big, min_time=0.2)
        a, b = torch.randn(4 * 2**20), torch.randn(4 * 2**20)
        result["add_s"] = _timeit(lambda: torch.add(a, b, out=a), min_time=0.1)  # reads 2, writes 1 × 16 MiB
        t1, t2 = torch.ones(1), torch.ones(1)
        result["tiny_op_s"] = _timeit(lambda: torch.add(t1, t2), min_time=0.05)
        for name in dtypes:
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            result[f"peak_gemm_s_{name}"] = _timeit(gemm_fn(1024, 1024, 1024, dtype), min_time=0.2)
    # DTensor dispatch: the same elementwise op on DTensors over a mesh of every rank (local, no communication)
    # and on plain tensors, rank 0 alone.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    da, db = (DTensor.from_local(torch.randn(64), mesh, [Shard(0)], run_check=False) for _ in range(2))
    if rank == 0:
        pa, pb = torch.randn(64), torch.randn(64)
        result["dtensor_op_s"] = max(0.0, _timeit(lambda: da + db, min_time=0.1) - _timeit(lambda: pa + pb, min_time=0.1))
    dist.barrier()
    # Phase 2: every rank at once, the same GEMMs between two barriers: the node's throughput is all of them over the
    # slowest rank's wall time. (Each rank's own best timing window over-counts where ranks outnumber cores: a rank
    # timing after others finished has their cores; it gave 2.76 units on 2 logical CPUs.)
    big()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CONCURRENT_CALLS):
        big()
    dist.barrier()
    result["concurrent_wall_s"] = time.perf_counter() - start
    # Phase 3: collectives per group size, every group at once.
    jobs: list[tuple[tuple[str, int, int], Any, int]] = []
    for g in [d for d in divisors(world) if d > 1]:
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]  # every rank creates every group
        group = groups[rank // g]
        for nbytes in SIZES:
            n = max(g, nbytes // 4 // g * g)
            x = torch.randn(n)
            ops = {
                "all_reduce": lambda x=x, group=group: dist.all_reduce(x, group=group),
                "all_gather": lambda x=x, n=n, g=g, group=group: all_gather_single(torch.empty(n), x[: n // g].contiguous(), group=group),
                "reduce_scatter": lambda x=x, n=n, g=g, group=group: reduce_scatter_single(torch.empty(n // g), x, group=group),
                "all_to_all": lambda x=x, n=n, group=group: dist.all_to_all_single(torch.empty(n), x, group=group),
            }
            if g == 2:  # point-to-point between the pair, both directions at once (pipeline neighbours)
                ops["p2p"] = lambda x=x, n=n, peer=rank ^ 1: [r.wait() for r in dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(n), peer)])]
            jobs += [((op, g, n * 4), fn, n * 4) for op, fn in ops.items()]
    seconds = interleaved_medians(jobs, _collective_round)
    timings: dict[str, dict[int, list[tuple[float, float]]]] = {op: {} for op in OPS}
    for (op, g, nbytes), t in seconds.items():
        timings[op].setdefault(g, []).append((float(nbytes), t))
    gathered = [None] * world
    dist.all_gather_object(gathered, timings)
    if rank == 0:
        result["collectives_raw"] = gathered
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's exit crash (DESIGN §5): the work is done and written


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``t = latency + sent / bandwidth`` over ``(bytes sent, seconds)``: least squares, kept physical — a slope no
    smaller than what the largest buffer alone implies at zero latency would allow is never fitted (a noisy small
    size must not make the link look infinitely fast), and the latency is at least the smallest time's half."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    big = max(range(len(xs)), key=xs.__getitem__)
    floor = (ys[big] - min(ys)) / xs[big] if xs[big] else 0.0
    slope = max(slope, floor, 1e-15)
    latency = max(my - slope * mx, min(ys) / 2)
    return latency, 1.0 / slope


def _sent(op: str, nbytes: float, g: int) -> float:
    return {"all_reduce": 2 * (g - 1) / g, "p2p": 1.0}.get(op, (g - 1) / g) * nbytes


def calibrate(w: Workload, world: int, *, dtypes: list[str] | None = None) -> Hardware:
    """Measure this machine with ``world`` processes (see the module docstring) and return its profile."""
    import torch.multiprocessing as mp

    if world < 2:
        raise ConfigError(f"--calibrate needs at least 2 processes to measure collectives (trainer.devices={world}).")
    dtypes = dtypes or ["fp32"] + (["bf16"] if w.precision.compute == "bf16" else [])
    shapes = gemm_shapes(w, world)
    with tempfile.TemporaryDirectory(prefix="pk_calibrate_") as tmp:
        out = Path(tmp) / "result.json"
        mp.start_processes(_worker, args=(world, tmp, shapes, dtypes, str(out)), nprocs=world, start_method="fork", join=True)
        result = json.loads(out.read_text())
    result["host_overheads_s"] = {**host_overheads(world), "dp_host_overhead": data_parallel_terms(w, world)}
    hardware = profile_from_measurements(result, world, dtypes)
    hardware = replace(hardware, optimizer_element_time=optimizer_element_time(w, max(1, (os.cpu_count() or 1) // world)))
    return replace(hardware, compute_scale=compute_scale(w, hardware, world))  # needs the optimizer's time


def compute_units_bound(world: int, threads_per_rank: int, cpus: int) -> float:
    """The most compute units ``world`` ranks of ``threads_per_rank`` threads can be measured to have: no rank runs
    faster beside the others than alone (``world``), and together they use at most the machine's ``cpus`` (each rank's
    one-process rate already uses its threads). A measured ratio above it is the one-process timing's noise (2.026 on
    2 CPUs once: the solo GEMM timed 1 % slow), not compute the cost model may count on."""
    return float(min(world, max(1.0, cpus / max(1, threads_per_rank))))


def profile_from_measurements(result: dict[str, Any], world: int, dtypes: list[str]) -> Hardware:
    flops = {name: 2 * 1024**3 / result[f"peak_gemm_s_{name}"] for name in dtypes}
    if "bf16" not in flops:
        flops["bf16"] = flops["fp32"]
    # every rank's GEMMs at the one-process rate, over the wall time they took all at once
    measured_units = world * CONCURRENT_CALLS * result["single_gemm_s"] / result["concurrent_wall_s"]
    units = min(measured_units, compute_units_bound(world, result.get("threads_per_rank", 1), result.get("cpus") or os.cpu_count() or 1))
    # Per (op, g): the slowest rank of the concurrently running groups decides, as in a collective.
    collectives: dict[str, dict[int, tuple[float, float]]] = {}
    per_rank = result["collectives_raw"]
    for op in OPS:
        for g in sorted({int(k) for r in per_rank for k in r[op]}):
            rows = [r[op][str(g)] if str(g) in r[op] else r[op][g] for r in per_rank]
            points = [(_sent(op, rows[0][i][0], g), max(row[i][1] for row in rows)) for i in range(len(rows[0]))]
            collectives.setdefault(op, {})[g] = fit_latency_bandwidth(points)
    host_terms = result.get("host_overheads_s") or {}
    ar = collectives["all_reduce"][max(collectives["all_reduce"])]
    link = Link(bandwidth=ar[1], latency=ar[0] / 2)
    host = socket.gethostname()
    import torch

    source = (f"measured by `python -m parallelkit.plan --calibrate` on {host} ({platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} logical CPUs) at {datetime.now(timezone.utc).isoformat(timespec='seconds')}: {world} processes, "
              f"torch {torch.__version__}, gloo; compute units = every rank's GEMMs at the one-process rate / their wall time all at once")
    if units < measured_units:
        source += f" ({measured_units:.3f} measured, capped at {units:g}: a timing noise over what the ranks' threads can use)"
    return Hardware(
        name=f"calibrated_{host}_{world}x_gloo", devices_per_node=world, memory_per_device=host_memory_per_rank(world),
        matmul_flops=flops, memory_bandwidth=3 * 4 * 2**22 / result["add_s"], kernel_overhead=result["tiny_op_s"],
        **{name: value for name, value in host_terms.items() if name in HOST_TERMS},
        **{name: {int(g): tuple(float(x) for x in v) for g, v in dict(host_terms.get(name) or {}).items()} for name in PARALLEL_HOST_TERMS},
        dtensor_op_overhead=result.get("dtensor_op_s", 0.0),
        intra_node=link, inter_node=link, compute_units_per_node=round(units, 3), collectives=collectives,
        matmul_measured=result["matmul_measured"], backend="gloo", sources=(source,),
    )
