"""parallelkit against ``transformers.Trainer``: the same Hugging Face causal LM, data, batch, optimizer and steps.

Two contenders train a Llama-family model built by parallelkit's ``model=hf`` on 2 gloo ranks (DDP), each
launched as one job (a subprocess), so the whole-process wall time includes start-up and teardown:

- ``parallelkit``: ``python train.py model=hf model.family=llama ... data=text data.files=[corpus.txt]
  strategy=ddp trainer.devices=2``, the default config otherwise (validation off, checkpoint only at the end);
- ``trainer``: this file under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` (``--worker``):
  ``transformers.Trainer`` with ``use_cpu=True, ddp_backend="gloo"``, its defaults otherwise (fused AdamW,
  ``find_unused_parameters=True``, tqdm bar, one checkpoint at the last step).

Like for like: the same initial weights (the model is built by the same ``HFCausalLM`` call after the same
seeding), the same token windows in the same order per step and rank (the Trainer's dataset is parallelkit's
windows laid out in parallelkit's global order, read sequentially, which accelerate's batch sharding deals out
exactly as ``DataParallelBatchSampler`` does), the same loss (mean cross-entropy of the logits against the given,
already shifted labels), AdamW with conf/optim/adamw.yaml's lr and betas, no weight decay (the Trainer would
exempt the norm weights from it), no gradient clipping, and parallelkit's warm-up + cosine schedule (the
Trainer's own warm-up starts at lr 0). Both sides memory-map the same token cache, written once before the rounds.
The losses agree to round-off in the first steps, then drift apart slowly: the Trainer's default AdamW is the fused
kernel, parallelkit's the for-loop one; with ``--pk-args +optim.optimizer.fused=true`` they are bit-identical.

Rounds run the two jobs alternately first; the table shows the median over rounds of each job's median step
time (wall time between consecutive optimizer steps on rank 0, the first interval from the start of training),
whole-process wall time, time outside the steps and CPU seconds of all ranks, and the ratios parallelkit /
Trainer (median of the per-round ratios, with their range). It checks that the per-step losses agree, and plots
both loss curves.

    python bench/hf_trainer.py             # 4 rounds × 80 steps, hidden 384 × 4 layers (~1 s a step), ~15 min
    python bench/hf_trainer.py --quick     # 1 round × 20 steps, hidden 128 × 2 layers, ~1 minute
    python bench/hf_trainer.py --phases --rounds 2 --steps 40   # diagnostic: rank 0's step phases and timeline

Writes ``bench/results/hf_trainer.json`` and ``hf_trainer.png`` (``hf_trainer_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (bench/overhead.py: job running, subreaper, CPU accounting)

ROOT = overhead.ROOT
NAMES = ("parallelkit", "trainer")
LABELS = {"parallelkit": "parallelkit `strategy=ddp`", "trainer": "`transformers.Trainer` (DDP, gloo)"}
# The largest Llama whose DDP step takes about 1 s on the 2-core machine (global batch 32 × 128 bytes).
FULL = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3, intermediate_size=1024)
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=344)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--quick", action="store_true", help="1 round × 20 steps of a small model (overrides the sizes)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    for key, value in FULL.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    p.add_argument("--pk-args", default="", help="extra overrides for train.py (ablations, e.g. '+optim.optimizer.fused=true')")
    p.add_argument("--trainer-args", default="{}", help="JSON of extra TrainingArguments (ablations, e.g. '{\"optim\": \"adamw_torch\"}')")
    p.add_argument("--phases", action="store_true",
                   help="diagnostic: time each step's phases on rank 0 (wall and CPU) on both sides; adds a callback to each")
    p.add_argument("--loss-tol", type=float, default=1e-5,
                   help="max |Δ loss| over the first 10 steps (later steps drift: fused and for-loop AdamW round differently)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="default: bench/results/hf_trainer.json (hf_trainer_quick.json with --quick)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: the Trainer side, under torchrun
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.rounds, args.steps = 1, 20
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.out is None:  # a smoke run must not overwrite the measurement docs/benchmarks.md quotes
        args.out = str(ROOT / "bench" / "results" / ("hf_trainer_quick.json" if args.quick else "hf_trainer.json"))
    if args.rounds < 1 or args.steps < 3:
        p.error("--rounds must be ≥ 1 and --steps ≥ 3")
    return args


def sizes(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, key) for key in FULL}


# ------------------------------------------------------------------------- the data both sides train on
def prepare_data(args: argparse.Namespace, work: Path) -> dict:
    """Write the corpus (the Python documentation, one .txt document), tokenize it into parallelkit's cache and
    return what the Trainer side needs: the cache file and, in training order, the start of every window.

    The order is parallelkit's own: ``DataParallelBatchSampler`` of each rank, step by step, rank 0's micro-batch
    then rank 1's. Read sequentially in per-device batches, accelerate gives rank r batch 2·s + r at step s:
    exactly these windows.
    """
    import yaml

    from parallelkit.data.chars import load_python_docs
    from parallelkit.data.sampler import DataParallelBatchSampler
    from parallelkit.data.text import TextDataModule

    corpus, cache = work / "corpus.txt", work / "cache"
    corpus.write_text(load_python_docs(), encoding="utf-8")
    dm = TextDataModule(files=[str(corpus)], cache_dir=str(cache), seq_len=args.seq_len,
                        global_batch_size=args.global_batch_size, seed=args.seed)
    plan = dm.configure(data_parallel_size=2, accumulate=1)
    samplers = [DataParallelBatchSampler(len(dm.train_set), plan, rank, args.seed) for rank in (0, 1)]
    if args.steps > samplers[0].steps_per_epoch:
        raise SystemExit(f"--steps {args.steps} exceeds one epoch ({samplers[0].steps_per_epoch} steps)")
    order = [i for step in zip(*(iter(s) for s in samplers)) for batch in step for i in batch][: args.steps * plan.global_batch_size]
    optim = yaml.safe_load((ROOT / "conf" / "optim" / "adamw.yaml").read_text())
    return {
        "cache": str(dm.cache_path), "dtype": dm.train_set.tokens.dtype.str, "num_tokens": len(dm.train_set.tokens),
        "starts": [dm.train_set.starts[i] for i in order], "corpus": str(corpus), "cache_dir": str(cache),
        "vocab_size": dm.vocab_size, "per_device_batch_size": plan.micro_batch_size,
        "lr": optim["optimizer"]["lr"], "betas": optim["optimizer"]["betas"],
        "warmup_steps": optim["schedule"]["warmup_steps"], "min_lr_ratio": optim["schedule"]["min_lr_ratio"],
    }


def commands(args: argparse.Namespace, run_dir: Path, data: dict, worker_cfg: Path) -> dict[str, list[str]]:
    """Both jobs, writing under ``run_dir/<name>`` (a fresh ``run_dir`` per round: parallelkit refuses to
    start over in a directory that holds a run)."""
    py = sys.executable
    model = [f"model.{k}={v}" for k, v in sizes(args).items()]
    return {
        "parallelkit": [
            py, "train.py", "model=hf", "model.family=llama", *model, "data=text", f"data.files=[{data['corpus']}]",
            f"data.cache_dir={data['cache_dir']}", f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}",
            "strategy=ddp", "trainer.devices=2", f"trainer.max_steps={args.steps}", f"seed={args.seed}",
            "trainer.limit_val_batches=0",  # the Trainer side does not evaluate
            "optim.optimizer.weight_decay=0.0",  # the Trainer exempts norm weights from decay: none on either side
            "checkpoint.every_n_steps=0", "checkpoint.every_n_minutes=0",  # one checkpoint, at the end, as the Trainer's
            f"hydra.run.dir={run_dir / 'parallelkit'}", *args.pk_args.split(),
            *([f"+callbacks={{phases:{{_target_:hf_trainer.lightning_phase_probe,out:{run_dir / 'parallelkit'}}}}}"] if args.phases else []),
        ],
        "trainer": [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "bench/hf_trainer.py",
                    f"--worker={worker_cfg}", f"--worker-out={run_dir / 'trainer'}"],
    }


# ------------------------------------------------------------------------- --phases: where the time goes
def process_start_time() -> float:
    """When this process was created, as ``time.time()`` (bench/probe.py's, without importing Lightning)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class PhaseMarks:
    """Per step, wall, this thread's and the process's CPU time at: batch_start, forward_end (the model returned its logits),
    optimizer_start (backward and its all-reduce done), step_end; what lies between step_end and the next
    batch_start is the loop itself and data loading. And the run's timeline (``time.time()``): process start,
    train start, first and last step end, trained (after the final checkpoint and the end-of-training hooks)."""

    def __init__(self, out: str, rank: int) -> None:
        self.path, self.steps, self.current = Path(out) / f"phases_rank{rank}.json", [], {}
        self.events = {"process_start": process_start_time(), "train_start": time.time()}

    def attach(self, model) -> None:
        model.register_forward_hook(lambda *_: self.mark("forward_end"))

    def mark(self, name: str) -> None:
        self.current[name] = (time.perf_counter(), time.thread_time(), time.process_time())
        if name == "step_end":
            self.steps.append(self.current)
            self.current = {}
            self.events.setdefault("first_step_end", time.time())
            self.events["last_step_end"] = time.time()

    def finish(self) -> None:
        self.events["trained"] = time.time()
        self.path.write_text(json.dumps({"steps": self.steps, "events": self.events}))


PHASES = (("forward", "batch_start", "forward_end", 0), ("loss + backward + all-reduce", "forward_end", "optimizer_start", 0),
          ("optimizer step, zero_grad, scheduler, hooks", "optimizer_start", "step_end", 0),
          ("between steps (loop, data)", "step_end", "batch_start", 1), ("whole step", "batch_start", "batch_start", 1))
TIMELINE = (("launch → rank 0 process starts", None, "process_start"), ("→ training starts (imports, build, rendezvous)", "process_start", "train_start"),
            ("→ first step ends", "train_start", "first_step_end"), ("→ last step ends", "first_step_end", "last_step_end"),
            ("→ trained (final checkpoint, end of training)", "last_step_end", "trained"), ("→ the job has exited", "trained", None))


def phase_medians(path: Path, launched: float, wall: float) -> dict[str, list[float]]:
    """Rank 0's median ms per step phase, [wall, main thread's CPU, all threads' CPU], over the steps after the
    first; and its timeline, in s."""
    data = json.loads(path.read_text())
    steps, events = data["steps"][1:], {**data["events"], None: launched}
    out = {}
    for label, start, end, next_step in PHASES:
        spans = [[b[end][k] - a[start][k] for k in range(3)] for a, b in zip(steps, steps[next_step:])]
        out[label] = [statistics.median(x[k] for x in spans) * 1e3 for k in range(3)]
    for label, start, end in TIMELINE:
        out[label] = ((launched + wall) if end is None else events[end]) - events[start]
    return out


def lightning_phase_probe(out: str):
    """parallelkit's side of ``--phases``: a Lightning callback (built here so that this file imports no Lightning)."""
    from lightning.pytorch.callbacks import Callback

    class LightningPhases(Callback):
        def on_train_start(self, trainer, pl_module):
            self.marks = PhaseMarks(out, trainer.global_rank)
            self.marks.attach(pl_module.model)  # HFCausalLM: its forward may run the decoder loop itself, not .hf's

        def on_train_batch_start(self, *_):
            self.marks.mark("batch_start")

        def on_before_optimizer_step(self, *_):
            self.marks.mark("optimizer_start")

        def on_train_batch_end(self, *_):
            self.marks.mark("step_end")

        def teardown(self, *_, **__):  # after every callback's on_train_end: parallelkit's final checkpoint is written
            self.marks.finish()

    return LightningPhases()


# ------------------------------------------------------------------------- the Trainer side (under torchrun)
def worker(cfg_path: str, out: str) -> None:
    cfg = {**json.loads(Path(cfg_path).read_text()), "out": out}
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from torch.utils.data import Dataset

    from parallelkit.models.hf.model import HFCausalLM

    class Windows(Dataset):
        """parallelkit's windows in training order: {input_ids: window[:-1], labels: window[1:]}."""

        def __init__(self) -> None:
            self.tokens = np.memmap(cfg["cache"], dtype=np.dtype(cfg["dtype"]), mode="r", shape=(cfg["num_tokens"],))

        def __len__(self) -> int:
            return len(cfg["starts"])

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            start = cfg["starts"][i]
            window = torch.from_numpy(self.tokens[start : start + cfg["seq_len"] + 1].astype(np.int64))
            return {"input_ids": window[:-1], "labels": window[1:]}

    losses: list[torch.Tensor] = []

    def loss_func(outputs, labels, num_items_in_batch=None):  # parallelkit's HFCausalLM.loss: no internal shift
        loss = F.cross_entropy(outputs.logits.flatten(0, 1).float(), labels.flatten())
        losses.append(loss.detach())
        return loss

    step_ends: list[float] = []
    marks = PhaseMarks(out, int(os.environ["RANK"])) if cfg["phases"] else None

    class StepTimes(transformers.TrainerCallback):
        def on_train_begin(self, *_, model=None, **__):
            step_ends.append(time.perf_counter())
            if marks:
                marks.attach(model)

        def on_step_begin(self, *_, **__):
            if marks:
                marks.mark("batch_start")

        def on_pre_optimizer_step(self, *_, **__):
            if marks:
                marks.mark("optimizer_start")

        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())
            if marks:
                marks.mark("step_end")

        def on_train_end(self, *_, **__):  # after the checkpoint of the last step
            if marks:
                marks.finish()

    warmup, steps, floor = cfg["warmup_steps"], cfg["steps"], cfg["min_lr_ratio"]

    def lr_factor(step: int) -> float:  # parallelkit's TrainModule._lr_factor, decay_steps = max_steps
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    class SameScheduleTrainer(transformers.Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lr_factor)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    transformers.set_seed(cfg["seed"])  # as parallelkit's seed_everything right before it builds the model
    model = HFCausalLM(vocab_size=cfg["vocab_size"], block_size=cfg["seq_len"], family="llama", **cfg["sizes"]).hf
    targs = transformers.TrainingArguments(
        output_dir=cfg["out"], max_steps=steps, per_device_train_batch_size=cfg["per_device_batch_size"],
        learning_rate=cfg["lr"], adam_beta1=cfg["betas"][0], adam_beta2=cfg["betas"][1], weight_decay=0.0,
        max_grad_norm=0.0, seed=cfg["seed"], use_cpu=True, ddp_backend="gloo", report_to="none",
        train_sampling_strategy="sequential",  # the dataset is already in parallelkit's order
        average_tokens_across_devices=False,  # else the Trainer multiplies a per-batch mean loss by the world size
        logging_steps=25,  # as parallelkit's trainer.log_every_n_steps: a cross-rank loss average every 25 steps
        save_strategy="steps", save_steps=steps,  # one checkpoint (weights, optimizer, scheduler), at the end
        **cfg["trainer_args"],
    )
    trainer = SameScheduleTrainer(model=model, args=targs, train_dataset=Windows(), compute_loss_func=loss_func,
                                  callbacks=[StepTimes()])
    trainer.train()
    import torch.distributed as dist

    mean = torch.stack(losses)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    if dist.get_rank() == 0:
        durations = [b - a for a, b in zip(step_ends[:-1], step_ends[1:])]
        summary = {"train_loss": mean.tolist(), "step_time_s_median": statistics.median(durations),
                   "num_params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
                   "optimizer": {"class": type(opt := trainer.optimizer.optimizer).__name__, "fused": opt.defaults["fused"],
                                 "groups": [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in opt.param_groups]},
                   "ddp": {"find_unused_parameters": trainer.model_wrapped.find_unused_parameters}}
        Path(cfg["out"], "summary.json").write_text(json.dumps(summary, default=str))
    dist.destroy_process_group()


# ------------------------------------------------------------------------- rounds, table, plot
def run_contender(name: str, cmd: list[str], run_dir: Path, args: argparse.Namespace) -> dict:
    out = run_dir / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    cpu_before = overhead.children_cpu_s()
    wall, code, launched = overhead.run_job(cmd, out / "job.log", False, args.timeout)
    if not (out / "summary.json").exists():
        tail = (out / "job.log").read_bytes()[-4000:].decode(errors="replace")
        raise SystemExit(f"{name} wrote no summary.json (exit code {code}). Command:\n  {' '.join(cmd)}\nLog tail:\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    rec = {"wall_s": wall, "exit_code": code, "cpu_s": overhead.children_cpu_s() - cpu_before,
           "step_time_s_median": summary["step_time_s_median"], "train_loss": summary["train_loss"],
           "num_params": summary["num_params"]}
    rec["outside_steps_s"] = wall - len(rec["train_loss"]) * rec["step_time_s_median"]
    for key in ("threads", "optimizer", "ddp"):
        if key in summary:
            rec[key] = summary[key]
    if args.phases:
        rec["phases"] = phase_medians(out / "phases_rank0.json", launched, wall)
    return rec


def aggregate(rounds: list[dict]) -> dict:
    agg = {}
    for name in NAMES:
        entry = {}
        for key in ("step_time_s", "wall_s", "outside_steps_s", "cpu_s"):
            src = "step_time_s_median" if key == "step_time_s" else key
            entry[key + "_median"] = statistics.median(r[name][src] for r in rounds)
            ratios = [r[name][src] / r["trainer"][src] for r in rounds]
            entry[key + "_ratio_median"] = statistics.median(ratios)
            entry[key + "_ratio_range"] = [min(ratios), max(ratios)]
        agg[name] = entry
    return agg


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "hf_trainer.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; bench/docs_tables.py)."""
    first_round = {name: {"train_loss": results["train_loss"][name]} for name in NAMES}
    return {"": markdown_table(results["aggregate"], [first_round])}


def markdown_table(agg: dict, rounds: list[dict]) -> str:
    lines = ["| | step time (median) | × Trainer, per step | whole process | × Trainer, whole process | outside the steps | "
             "CPU, all ranks | × Trainer, CPU | final loss |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in NAMES:
        a = agg[name]
        ratio = lambda key: f"**{a[key + '_ratio_median']:.3f}** ({a[key + '_ratio_range'][0]:.2f}–{a[key + '_ratio_range'][1]:.2f})"  # noqa: E731
        lines.append(f"| {LABELS[name]} | {a['step_time_s_median'] * 1e3:.0f} ms | {ratio('step_time_s')} | {a['wall_s_median']:.1f} s | "
                     f"{ratio('wall_s')} | {a['outside_steps_s_median']:.1f} s | {a['cpu_s_median']:.1f} s | {ratio('cpu_s')} | "
                     f"{rounds[0][name]['train_loss'][-1]:.4f} |")
    return "\n".join(lines)


def phases_table(rounds: list[dict]) -> str:
    """Rank 0's medians over rounds: ms per step phase (wall / main thread's CPU / all threads' CPU), and seconds
    on the timeline from the launch."""
    med = lambda name, label, k=None: statistics.median(  # noqa: E731
        r[name]["phases"][label] if k is None else r[name]["phases"][label][k] for r in rounds)
    lines = ["| phase (rank 0, ms per step: wall / CPU main thread / CPU all threads) | parallelkit | Trainer | "
             "CPU main thread: parallelkit − Trainer |", "|---|---:|---:|---:|"]
    for label, *_ in PHASES:
        pk, hf = [med("parallelkit", label, k) for k in range(3)], [med("trainer", label, k) for k in range(3)]
        lines.append(f"| {label} | {' / '.join(f'{x:.1f}' for x in pk)} | {' / '.join(f'{x:.1f}' for x in hf)} | {pk[1] - hf[1]:+.1f} |")
    lines += ["", "| timeline (rank 0, s) | parallelkit | Trainer | parallelkit − Trainer |", "|---|---:|---:|---:|"]
    for label, *_ in TIMELINE:
        pk, hf = med("parallelkit", label), med("trainer", label)
        lines.append(f"| {label} | {pk:.2f} | {hf:.2f} | {pk - hf:+.2f} |")
    return "\n".join(lines)


def plot(rounds: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pk, hf = rounds[0]["parallelkit"]["train_loss"], rounds[0]["trainer"]["train_loss"]
    steps = range(1, len(pk) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, pk, label=LABELS["parallelkit"].replace("`", ""), lw=2)
    top.plot(steps, hf, label=LABELS["trainer"].replace("`", ""), lw=1, ls="--")
    top.set_ylabel("training loss (global mean)")
    top.set_title(title, fontsize=9)
    top.legend()
    bottom.plot(steps, [a - b for a, b in zip(pk, hf)], color="k", lw=1)
    bottom.set_ylabel("parallelkit − Trainer")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.worker_out)
    if args.table:
        print(tables(json.loads(Path(args.out).read_text()))[""])
        return
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded, on either side
    if args.phases:  # train.py finds the probe's _target_ (hf_trainer.lightning_phase_probe) on the path
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
    overhead.become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="pk_hf_trainer_"))
    data = prepare_data(args, work)
    worker_cfg = work / "trainer_worker.json"
    worker_cfg.write_text(json.dumps({**data, "seq_len": args.seq_len, "steps": args.steps, "seed": args.seed, "sizes": sizes(args),
                                      "trainer_args": json.loads(args.trainer_args), "phases": args.phases}))
    cmds = [commands(args, work / f"round{r + 1}", data, worker_cfg) for r in range(args.rounds)]
    model_desc = (f"llama hidden {args.hidden_size} × {args.num_hidden_layers} layers, {args.num_attention_heads} heads "
                  f"({args.num_key_value_heads} kv), MLP {args.intermediate_size}, vocabulary {data['vocab_size']} (bytes)")
    print(f"hf_trainer: {args.rounds} rounds × {args.steps} steps, {model_desc}, seq_len {args.seq_len}, global batch "
          f"{args.global_batch_size} on 2 ranks; runs in {work}", flush=True)
    rounds: list[dict] = []
    started = time.perf_counter()
    for r in range(args.rounds):
        result = {}
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            result[name] = rec = run_contender(name, cmds[r][name], work / f"round{r + 1}", args)
            print(f"  round {r + 1}/{args.rounds} {name:11s} step {rec['step_time_s_median'] * 1e3:7.1f} ms  process {rec['wall_s']:6.1f} s  "
                  f"outside steps {rec['outside_steps_s']:5.1f} s  CPU {rec['cpu_s']:6.1f} s  final loss {rec['train_loss'][-1]:.4f}  "
                  f"exit {rec['exit_code']}", flush=True)
        rounds.append(result)

    agg = aggregate(rounds)
    table = markdown_table(agg, rounds)
    pk_losses, hf_losses = [r["parallelkit"]["train_loss"] for r in rounds], [r["trainer"]["train_loss"] for r in rounds]
    diffs = [abs(a - b) for p, h in zip(pk_losses, hf_losses) for a, b in zip(p, h)]
    same_length = all(len(p) == len(h) == args.steps for p, h in zip(pk_losses, hf_losses))
    check = {"max_abs_diff": max(diffs) if same_length else float("inf"),
             "max_abs_diff_first_10_steps": max(abs(a - b) for p, h in zip(pk_losses, hf_losses) for a, b in zip(p[:10], h[:10])),
             "final_loss_diff": pk_losses[0][-1] - hf_losses[0][-1],
             "parallelkit_reproducible": all(p == pk_losses[0] for p in pk_losses),
             "trainer_reproducible": all(h == hf_losses[0] for h in hf_losses)}
    print(f"\nmodel: {model_desc}; {rounds[0]['parallelkit']['num_params']:,} parameters "
          f"(Trainer side: {rounds[0]['trainer']['num_params']:,})\n\n{table}\n")
    ok = same_length and check["max_abs_diff_first_10_steps"] <= args.loss_tol
    print(
        f"loss check: max |Δ loss| over the first 10 steps {check['max_abs_diff_first_10_steps']:.2e} ({'OK' if ok else 'MISMATCH'}, "
        f"tolerance {args.loss_tol:g}); over all {args.steps} steps {check['max_abs_diff']:.2e}, final losses "
        f"{pk_losses[0][-1]:.4f} / {hf_losses[0][-1]:.4f}; identical in every round: parallelkit {check['parallelkit_reproducible']}, "
        f"Trainer {check['trainer_reproducible']}"
    )
    bad = [(i, n, rec["exit_code"]) for i, rr in enumerate(rounds) for n, rec in rr.items() if rec["exit_code"] != 0]
    if bad:
        print(f"non-zero exit codes (round, contender, code): {bad}")
    if args.phases:
        print(f"\n{phases_table(rounds)}\n")
    print(f"total {time.perf_counter() - started:.0f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(rounds, png, f"{model_desc}\nseq {args.seq_len}, global batch {args.global_batch_size}, 2 gloo ranks, AdamW + warm-up/cosine")
    out.write_text(json.dumps({
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
        "model": model_desc, "commands": {k: " ".join(v[1:]) for k, v in cmds[0].items()},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "aggregate": agg, "loss_check": check, "markdown": table, "phases": phases_table(rounds) if args.phases else None,
        "train_loss": {"parallelkit": pk_losses[0], "trainer": hf_losses[0]},
        "rounds": [{n: {k: v for k, v in rec.items() if k != "train_loss"} for n, rec in rr.items()} for rr in rounds],
    }, indent=1))
    print(f"wrote {out} and {png}")
    if args.keep:
        print(f"run directories kept in {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
