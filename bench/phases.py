"""Where the start-up time goes: a per-rank timeline of each contender of ``bench/overhead.py``.

Runs the three jobs (interleaved, ``--rounds`` times) with start-up probes — ``bench/probe.py``'s
``PhaseProbe`` callback for parallelkit (through a Hydra override) and Lightning, ``--probe`` for the
hand-written loop — and prints, per contender and rank, the median time (seconds after the job was
launched) at which each phase ended:

    process_start              the rank's process exists (rank 1: when rank 0 launched it)
    callbacks_built            imports, config, data and model done (loop: ``data_built``)
    setup_process_group_ready  rendezvous done
    fit_start_model_wrapped    DDP wrapped, optimizer built
    train_start, first_batch_start ... first_step_end (the first step's phases), last_step_end, train_end
    exit                       rank 0's process has exited (the whole-process time)

    python bench/phases.py --rounds 3 --steps 30

A diagnostic for the overhead analysis; the numbers to quote come from ``bench/overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (bench/overhead.py)

MARKS = (
    "process_start",
    "imports_done",
    "callbacks_built",
    "setup_process_group_ready",
    "fit_start_model_wrapped",
    "train_start",
    "first_batch_start",
    "first_forward_end",
    "first_backward_end",
    "first_optimizer_step_start",
    "first_step_end",
    "last_step_end",
    "train_end",
    "teardown",
)

PER_STEP = ("wall_ms_per_step", "cpu_ms_per_step")  # medians over steps, not timestamps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tty", action="store_true")
    p.add_argument("--pk-args", default="")
    p.add_argument("--out", default=str(overhead.ROOT / "bench" / "results" / "phases.json"))
    ns = p.parse_args(argv)
    args = overhead.parse_args(["--rounds", str(ns.rounds), "--steps", str(ns.steps), "--pk-args", ns.pk_args] + (["--tty"] if ns.tty else []))
    overhead.become_subreaper()
    run_root = Path(tempfile.mkdtemp(prefix="pk_phases_"))
    cmds = overhead.commands(args, run_root)
    cmds["parallelkit"].append(f"+callbacks={{probe:{{_target_:bench.probe.PhaseProbe,out:{run_root / 'parallelkit'}}}}}")
    cmds["ddp_loop"].append("--probe")
    cmds["lightning"].append("--probe")

    names = list(overhead.CONTENDERS)
    timelines: dict[str, list[dict[str, dict[str, float]]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[: r % 3]:
            rec = overhead.run_contender(name, cmds[name], run_root, args)
            t0 = rec["launched"]
            ranks = {}
            for probe in sorted((run_root / name).glob("probe_rank*.json")):
                marks = json.loads(probe.read_text())
                if "data_built" in marks:  # the loop's name for the same point
                    marks["callbacks_built"] = marks.pop("data_built")
                ranks[probe.stem.removeprefix("probe_")] = {k: v if k.endswith("_per_step") else v - t0 for k, v in marks.items()}
                probe.unlink()
            ranks["rank0"]["exit"] = rec["wall_s"]
            ranks["rank0"]["cpu_s_all_ranks"] = rec["cpu_s"]
            timelines[name].append(ranks)
            print(f"  round {r + 1} {name:12s} process {rec['wall_s']:.2f} s, CPU {rec['cpu_s']:.2f} s", flush=True)

    medians: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        medians[name] = {}
        for rank in sorted(timelines[name][0]):
            keys = [k for k in (*MARKS, *PER_STEP, "exit", "cpu_s_all_ranks") if all(k in t[rank] for t in timelines[name])]
            medians[name][rank] = {k: statistics.median(t[rank][k] for t in timelines[name]) for k in keys}

    print(f"\nmedian seconds after launch, {args.rounds} rounds, {args.steps} steps (GPT n_layer={args.n_layer} n_embd={args.n_embd})\n")
    header = "| phase ends | " + " | ".join(f"{n} r0 | {n} r1" for n in names) + " |"
    print(header)
    print("|---|" + "---:|" * (2 * len(names)))
    for key in (*MARKS, "exit", "cpu_s_all_ranks", *PER_STEP):
        cells = []
        for name in names:
            for rank in ("rank0", "rank1"):
                v = medians[name].get(rank, {}).get(key)
                cells.append("" if v is None else f"{v:.2f}")
        if any(cells):
            print(f"| {key} | " + " | ".join(cells) + " |")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"config": vars(ns), "commands": {k: " ".join(v[1:]) for k, v in cmds.items()}, "medians": medians, "rounds": timelines}, indent=1)
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
