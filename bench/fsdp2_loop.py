"""FSDP2 with its defaults in a hand-written loop: ``bench/zero_speed.py``'s reference for stock ZeRO-3.

What a user of plain PyTorch would write for the job ``python train.py strategy=zero strategy.stage=3
trainer.devices=2`` runs: the same GPT (``parallelkit.models.gpt.GPT``), the same token stream and batch order
(parallelkit's ``DataParallelBatchSampler``), the same seed, AdamW and warm-up + cosine schedule, sharded with
``torch.distributed.fsdp.fully_shard`` per transformer block, then the root, with every FSDP2 default:
``reshard_after_forward`` left unset (blocks reshard after forward, the root keeps its parameters), implicit
backward prefetch only, no explicit ``set_modules_to_*_prefetch``, synchronous all-gathers, FSDP2's own
collectives (on gloo its reduce-scatter is an all-reduce and a slice). No Lightning, no Hydra, no parallelkit
strategy code. The launch is ``bench/ddp_loop.py``'s: this process is rank 0 and starts the others first thing.

Rank 0 writes ``DIR/summary.json`` with the fields of parallelkit's ``RunSummary`` that the benchmark reads:
``step_time_s_median`` (wall time between consecutive optimizer steps, the first interval starting just before
the first batch), ``train_loss`` (global mean per step), ``model_state_bytes`` (params / grads / optimizer bytes
this rank holds — grads measured after the first backward, the rest at the end — maximum over ranks) and
``peak_rss_bytes`` (maximum over ranks).

    python bench/fsdp2_loop.py --world-size 2 --out DIR [--steps 100 --n-layer 4 --n-embd 128 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ddp_loop import (  # bench/ is sys.path[0] when run as a script
    add_loop_arguments,
    launch_children,
    listen_locally,
    lr_factor,
    python_docs_tokens,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_loop_arguments(p)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    children = launch_children(args.world_size, __file__) if "RANK" not in os.environ else []
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, Dataset

    from parallelkit.data.batching import BatchPlan
    from parallelkit.data.sampler import DataParallelBatchSampler
    from parallelkit.models.gpt import GPT
    from parallelkit.process_stats import model_state_bytes, peak_rss_bytes

    # Lightning's rule (cores / local ranks) unless OMP_NUM_THREADS says otherwise, as for train.py's ranks.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // world)))
    ids, vocab = python_docs_tokens(args.vocab_multiple)
    tokens = torch.tensor(ids, dtype=torch.long)
    train_tokens = tokens[: int(len(tokens) * (1 - args.val_fraction))]
    seq = args.seq_len

    class Windows(Dataset):  # parallelkit.data.chars.CharDataset with stride = seq_len
        def __len__(self) -> int:
            return len(range(0, len(train_tokens) - seq, seq))

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            w = train_tokens[i * seq : i * seq + seq + 1]
            return w[:-1], w[1:]

    dataset = Windows()
    plan = BatchPlan.resolve(global_batch_size=args.global_batch_size, per_device_batch_size=None, data_parallel_size=world)
    loader = DataLoader(dataset, batch_sampler=DataParallelBatchSampler(len(dataset), plan, rank, args.seed))
    listen_locally(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(args.seed)
    model = GPT(vocab_size=vocab, block_size=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    num_params = sum(p.numel() for p in model.parameters())
    for block in model.layers.values():  # one unit per transformer block, then the root: FSDP2's documented recipe
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    decay = args.steps if args.decay_steps is None else args.decay_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.warmup_steps, decay, args.min_lr_ratio))

    losses: list[torch.Tensor] = []
    grad_bytes = 0
    step_ends = [time.perf_counter()]
    batches = iter(loader)
    for _ in range(args.steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:  # next epoch (the same order as Lightning's set_epoch)
            loader.batch_sampler.set_epoch(loader.batch_sampler.epoch + 1)
            batches = iter(loader)
            inputs, targets = next(batches)
        loss = model.loss(model(inputs), targets)
        loss.backward()
        if not grad_bytes:  # gradients exist between backward and zero_grad (RunSummary measures them here too)
            grad_bytes = model_state_bytes(model, [optimizer])["grads"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.detach())
        step_ends.append(time.perf_counter())

    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    state = model_state_bytes(model, [optimizer])
    state["grads"] = max(state["grads"], grad_bytes)
    maxima = torch.tensor([float(peak_rss_bytes()), *map(float, state.values())], dtype=torch.float64)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    if rank == 0:
        import itertools
        import statistics

        durations = [b - a for a, b in itertools.pairwise(step_ends)]
        os.makedirs(args.out, exist_ok=True)
        summary = {
            "strategy": "fsdp2_loop",
            "world_size": world,
            "steps": args.steps,
            "global_batch_size": plan.global_batch_size,
            "num_params": num_params,
            "train_loss": mean_losses.tolist(),
            "step_time_s_median": statistics.median(durations),
            "step_times_s": durations,
            "peak_rss_bytes": int(maxima[0]),
            "model_state_bytes": dict(zip(state.keys(), (int(v) for v in maxima[1:].tolist()))),
        }
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
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
