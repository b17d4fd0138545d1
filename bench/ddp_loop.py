"""The reference for ``bench/overhead.py``: a hand-written DDP training loop, no Lightning, no Hydra.

What a careful engineer would write by hand for the same job as
``python train.py strategy=ddp trainer.devices=2``: the same GPT, the same token stream and batch order
(parallelkit's ``DataParallelBatchSampler`` and ``BatchPlan``), the same AdamW and learning-rate schedule,
plain ``torch.nn.parallel.DistributedDataParallel`` over gloo (NCCL on GPU is not the point here).

Launch: ``python bench/ddp_loop.py --world-size 2 --out DIR ...``. The launching process is rank 0; before
importing torch it starts ranks 1..N-1 as copies of itself, so all ranks import and build at the same time
(Lightning's launcher starts them only when rank 0 reaches ``trainer.fit``). Rendezvous: TCP on 127.0.0.1.

Rank 0 writes ``DIR/summary.json`` with ``step_time_s_median`` measured like parallelkit's ``RunSummary``
(wall time between consecutive optimizer steps, the first interval starting just before the first batch),
``train_loss`` (global mean per step, reduced once at the end); with ``--probe`` every rank writes
``probe_rank{R}.json`` with start-up timestamps named as in ``bench/probe.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from workload_args import add_workload_arguments  # bench/ is sys.path[0] when run as a script


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    """What every hand-written loop here takes: output, workload, world size, and the train.py defaults it mirrors."""
    p.add_argument("--out", required=True, help="directory for summary.json")
    add_workload_arguments(p)
    p.add_argument("--world-size", type=int, default=2)
    # conf/optim/adamw.yaml, conf/data/chars.yaml
    p.add_argument("--lr", type=float, default=3.0e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99))
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--vocab-multiple", type=int, default=64)
    p.add_argument("--val-fraction", type=float, default=0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_loop_arguments(p)
    p.add_argument("--probe", action="store_true", help="write probe_rank{R}.json with start-up timestamps")
    p.add_argument("--comm-hook", choices=("builtin", "parallelkit"), default="builtin",
                   help="parallelkit: register parallelkit's counting allreduce_hook, as strategy=ddp does (ablation)")
    return p.parse_args(argv)


def process_start_time() -> float:
    """When this process was created, as ``time.time()`` (as ``bench/probe.py``, without importing Lightning)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        now, uptime = time.time(), float(f.read().split()[0])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_locally(rank: int) -> None:
    """Before ``init_process_group``: the store, gloo's listeners, on the ranks' loopback address only — as
    parallelkit's own runs do (:mod:`parallelkit.distributed.listeners`), not on every interface."""
    from parallelkit.distributed.listeners import bind_listeners

    bind_listeners(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, one_machine=True)


def launch_children(world_size: int, script: str = __file__) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 of ``script`` right away (this process becomes rank 0), like torchrun would, minus torchrun."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = "0"
    procs = []
    for rank in range(1, world_size):
        env = dict(os.environ, RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), *sys.argv[1:]], env=env))
    return procs


def lr_factor(step: int, warmup: int, decay: int, min_ratio: float) -> float:
    """The schedule of ``parallelkit.models.module.TrainModule`` (linear warm-up, cosine decay)."""
    import math

    if step < warmup:
        return (step + 1) / warmup
    if not decay:
        return 1.0
    progress = min(1.0, (step - warmup) / decay)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def python_docs_tokens(vocab_multiple: int) -> tuple[list[int], int]:
    """The token stream of ``data=chars`` (``CharsDataModule.build``): the packaged pydoc topics snapshot."""
    from parallelkit.data.chars import load_python_docs

    text = load_python_docs()
    chars = sorted(set(text))
    index = {ch: i for i, ch in enumerate(chars)}
    vocab = -(-len(chars) // vocab_multiple) * vocab_multiple
    return [index[ch] for ch in text], vocab


def main() -> None:
    args = parse_args()
    children = launch_children(args.world_size) if "RANK" not in os.environ else []
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, Dataset

    from parallelkit.data.batching import BatchPlan
    from parallelkit.data.sampler import DataParallelBatchSampler
    from parallelkit.models.gpt import GPT

    marks = {"process_start": process_start_time(), "imports_done": time.time()}
    # Lightning's rule (lightning.fabric.utilities.distributed._set_num_threads_if_needed): cores / local ranks.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))

    ids, vocab = python_docs_tokens(args.vocab_multiple)
    tokens = torch.tensor(ids, dtype=torch.long)
    train_tokens = tokens[: int(len(tokens) * (1 - args.val_fraction))]
    seq = args.seq_len

    class Windows(Dataset):  # parallelkit.data.chars.CharDataset with stride = seq_len
        def __init__(self, tokens: torch.Tensor) -> None:
            self.tokens, self.starts = tokens, range(0, len(tokens) - seq, seq)

        def __len__(self) -> int:
            return len(self.starts)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            w = self.tokens[self.starts[i] : self.starts[i] + seq + 1]
            return w[:-1], w[1:]

    dataset = Windows(train_tokens)
    plan = BatchPlan.resolve(global_batch_size=args.global_batch_size, per_device_batch_size=None, data_parallel_size=world)
    loader = DataLoader(dataset, batch_sampler=DataParallelBatchSampler(len(dataset), plan, rank, args.seed))

    marks["data_built"] = time.time()
    listen_locally(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    marks["setup_process_group_ready"] = time.time()

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(GPT(vocab_size=vocab, block_size=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    if args.comm_hook == "parallelkit":
        from parallelkit.distributed.comm_hooks import HookState, allreduce_hook
        from parallelkit.distributed.comm_stats import CommStats

        model.register_comm_hook(HookState(process_group=dist.group.WORLD, stats=CommStats()), allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    decay = args.steps if args.decay_steps is None else args.decay_steps
    if args.warmup_steps or decay:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.warmup_steps, decay, args.min_lr_ratio))
    else:
        schedule = None

    marks["fit_start_model_wrapped"] = time.time()
    losses: list[torch.Tensor] = []
    step_ends, step_cpu = [time.perf_counter()], [time.process_time()]
    marks["train_start"] = time.time()
    batches = iter(loader)
    for _ in range(args.steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:  # next epoch (the same order as Lightning's set_epoch)
            loader.batch_sampler.set_epoch(loader.batch_sampler.epoch + 1)
            batches = iter(loader)
            inputs, targets = next(batches)
        marks.setdefault("first_batch_start", time.time())
        loss = model.module.loss(model(inputs), targets)
        marks.setdefault("first_forward_end", time.time())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        marks.setdefault("first_backward_end", time.time())
        marks.setdefault("first_optimizer_step_start", time.time())
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.detach())
        step_ends.append(time.perf_counter())
        step_cpu.append(time.process_time())
        marks.setdefault("first_step_end", time.time())
    marks["last_step_end"] = marks["train_end"] = time.time()

    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    if rank == 0:
        import statistics

        durations = [b - a for a, b in zip(step_ends[:-1], step_ends[1:])]
        os.makedirs(args.out, exist_ok=True)
        summary = {
            "contender": "ddp_loop",
            "world_size": world,
            "steps": args.steps,
            "global_batch_size": plan.global_batch_size,
            "num_params": sum(p.numel() for p in model.parameters()),
            "train_loss": mean_losses.tolist(),
            "step_time_s_median": statistics.median(durations),
            "step_times_s": durations,
        }
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    if args.probe:
        import statistics

        for key, stamps in (("wall_ms_per_step", step_ends), ("cpu_ms_per_step", step_cpu)):  # as bench/probe.py
            deltas = [b - a for a, b in zip(stamps[1:-1], stamps[2:])]
            marks[key] = statistics.median(deltas) * 1e3 if deltas else float("nan")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"probe_rank{rank}.json"), "w") as f:
            json.dump(marks, f, indent=1)
    # gloo aborts about 1 run in 5 during interpreter shutdown, after the work is done ("terminate called
    # without an active exception"): leave without it.
    dist.barrier()
    dist.destroy_process_group()
    code = max([p.wait() for p in children], default=0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
