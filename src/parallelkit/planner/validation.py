"""The planner against published large-scale training runs (``published/runs.yaml``; docs/planner.md).

For each run: compose its workload from overrides alone (no corpus), cost the published layout on the named
hardware profile with the run's own precision, recomputation and overlap, and compare the predicted tokens/s per
device with the published figure (converted from the source's own FLOP count). Then ask ``strategy=auto`` what it
would run instead on the same machine — as parallelkit trains (hybrid4d, ``trainer.precision=bf16-mixed``, FSDP2
overlapped, the dp all-reduce after backward, sequence parallelism where the search picks it) — and with what
prediction. Where parallelkit can run the published degrees (:func:`parallelkit_can_run`), that answer is never
predicted slower than the published layout (``tests/unit/test_planner_validation.py``).

    python -m parallelkit.planner.validation            # the table of docs/planner.md
    python -m parallelkit.planner.docs_tables           # rewrites that table in docs/planner.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.planner.hardware import Hardware, Link, load_profile
from parallelkit.planner.inputs import compose_config
from parallelkit.planner.layout import MULTI_STAGE, Layout
from parallelkit.planner.search import AutoPlan, Candidate, SearchOptions, batch_cuts, degree_problem, degree_sets, evaluate, search
from parallelkit.planner.workload import PRECISIONS, Runtime, Workload, workload_from_config

HERE = Path(__file__).parent / "published"


@dataclass
class Validation:
    name: str
    run: dict[str, Any]
    workload: Workload
    hardware: Hardware
    published: Candidate  # the published layout, costed
    published_tokens_per_s: float
    auto: AutoPlan | None = None
    auto_note: str = ""

    @property
    def ratio(self) -> float:
        return self.published.tokens_per_s_per_device / self.published_tokens_per_s


def runs() -> dict[str, dict[str, Any]]:
    import yaml

    return yaml.safe_load((HERE / "runs.yaml").read_text())


def flops_per_token(kind: str, w: Workload) -> float:
    """The FLOPs per token the source used to turn its measured time into the FLOP/s it published."""
    s, shape = w.seq_len, w.shape
    l, h, v = shape.layers, shape.hidden, shape.vocab
    if kind == "megatron":  # Narayanan et al. 2021, eq. (3) divided by B·s: recomputation included
        return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if kind == "palm":  # Chowdhery et al. 2022, appendix B: 6N + 12·L·H·Q·T with H·Q = h, T = s
        return 6 * w.num_params + 12 * l * h * s
    if kind == "bigscience":  # tr11 README: model size × 4 × 2 (hardware FLOPs with recomputation)
        return 8 * w.num_params
    raise ValueError(f"unknown FLOP count {kind!r}")


def workload_of_run(run: dict[str, Any], *, precision: str | None = None, runtime: Runtime | None = None) -> Workload:
    """The run's workload from its overrides (the HF configs are files beside this module)."""
    overrides = [o.replace("model.config=", f"model.config={HERE}/") if o.startswith("model.config=") else o for o in run["overrides"]]
    cfg = compose_config(overrides)
    w = workload_from_config(cfg)
    return w.with_(precision=PRECISIONS[precision or run["precision"]], recompute=run["recompute"],
                   attention=run.get("attention", "flash"), runtime=runtime or Runtime(**run.get("runtime", {})))


def hardware_of_run(run: dict[str, Any]) -> Hardware:
    hw = load_profile(run["hardware"])
    network = run.get("network") or {}
    if "inter_node_bandwidth" in network:
        hw = replace(hw, inter_node=Link(float(network["inter_node_bandwidth"]), hw.inter_node.latency))
    return hw


def published_layout(run: dict[str, Any], w: Workload, hw: Hardware) -> Candidate:
    """The published degrees and micro-batch; the unpublished cut (micro-batch count, virtual stages) at its best."""
    base = published_base(run)
    rank_batch = w.global_batch // base.dims.data_parallel_size
    micro, schedule = run["layout"]["micro_batch"], base.schedule
    if base.pp == 1:
        options = [replace(base, micro_batch=micro, accumulate=rank_batch // micro)]
    else:
        v = run["layout"].get("virtual_stages")
        opts = SearchOptions(schedule=schedule, virtual_stages=v, search_accumulate=False)
        cuts = [(a, m, vv) for a, m, vv in batch_cuts(w, base, opts) if rank_batch // m == micro]
        if schedule in MULTI_STAGE and v is None:
            cuts = cuts or [(1, rank_batch // micro, 2)]
        options = [replace(base, micro_batch=micro, microbatches=m, virtual_stages=vv) for _, m, vv in cuts]
    candidates = [evaluate(w, hw, layout) for layout in options]
    fitting = [c for c in candidates if c.fits] or candidates  # none fits: the fastest is reported, judged not to fit
    return min(fitting, key=lambda c: c.total_time)


def published_base(run: dict[str, Any]) -> Layout:
    """The published degrees (one :class:`ParallelDims`) and options, before the batch cut."""
    spec = dict(run["layout"])
    dp, sharding, tp, pp, cp = spec["dp"], spec["sharding"], spec["tp"], spec["pp"], spec.get("cp", 1)
    dims = ParallelDims(dp * sharding * cp * tp * pp, dp=dp, sharding=sharding, cp=cp, tp=tp, pp=pp)
    return Layout(dims, zero_stage=spec.get("zero_stage", 3 if sharding > 1 else 0), schedule=spec.get("schedule", "1f1b"),
                  reshard_after_forward=spec.get("reshard_after_forward", pp == 1),
                  sequence_parallel=bool(run.get("sequence_parallel", False)) and tp > 1,
                  embedding_and_loss_as_layers=bool(spec.get("embedding_and_loss_as_layers", False)),
                  microbatch_group=int(spec.get("microbatch_group", 0)), cp_mode=spec.get("cp_mode", "ring"))


def parallelkit_can_run(result: Validation) -> str | None:
    """Why parallelkit cannot run the published layout on the same machine (None: it can): the published degrees
    refused for parallelkit's workload (:func:`~parallelkit.planner.search.degree_problem`), or judged not to fit."""
    if not result.published.fits:
        return f"the published layout needs {result.published.memory['total'] / 2**30:.1f} GiB per device"
    ours = parallelkit_workload(result.run)
    layout = result.published.layout
    return degree_problem(ours, result.hardware, layout, SearchOptions(schedule=layout.schedule, sequence_parallel=layout.sequence_parallel,
                                                                       cp_mode=layout.cp_mode))


def parallelkit_workload(run: dict[str, Any]) -> Workload:
    """The run's workload as parallelkit trains it: ``trainer.precision=bf16-mixed``, parallelkit's overlap."""
    return workload_of_run(run, precision="amp", runtime=Runtime())


def validate(name: str, run: dict[str, Any], *, with_auto: bool = True) -> Validation:
    w = workload_of_run(run)
    hw = hardware_of_run(run)
    candidate = published_layout(run, w, hw)
    published = run["published"]
    if "tokens_per_s_per_gpu" in published:
        tokens = float(published["tokens_per_s_per_gpu"])
    else:
        tokens = published["teraflops_per_gpu"] * 1e12 / flops_per_token(run["flops_per_token"], w)
    result = Validation(name, run, w, hw, candidate, tokens)
    if with_auto:
        result.auto, result.auto_note = auto_instead(run, hw, candidate.layout.world)
    return result


def auto_instead(run: dict[str, Any], hw: Hardware, world: int) -> tuple[AutoPlan | None, str]:
    """What ``strategy=auto`` runs on the same machine: parallelkit's hybrid4d with ``trainer.precision=bf16-mixed``,
    sequence parallelism where the search picks it, FSDP2 overlapped and the dp all-reduce after backward; the run's
    recomputation, or ``full`` if nothing fits without."""
    from parallelkit.errors import ConfigError

    ours = parallelkit_workload(run)
    refused = refusals(ours, hw, world)
    if refused:
        return None, refused
    note = ""
    for recompute in dict.fromkeys([run["recompute"], "full"]):
        try:
            return search(ours.with_(recompute=recompute), hw, world, SearchOptions()), note
        except ConfigError as err:
            note = str(err).split(". ")[0]
    return None, note


def refusals(w: Workload, hw: Hardware, world: int) -> str:
    """Empty if some degree set of ``world`` ranks can run ``w``; else why none can, the most frequent reason per kind
    of layout (with tensor parallelism, with a pipeline and without tensor parallelism, with neither)."""
    from collections import Counter

    kinds: dict[str, Counter] = {}
    for dp, sharding, _, tp, pp, ep in degree_sets(world, w.shape.experts):
        layout = Layout(ParallelDims(world, dp=dp, sharding=sharding, tp=tp, pp=pp, ep=ep))
        problem = degree_problem(w, hw, layout, SearchOptions(sequence_parallel=False))
        if problem is None:
            return ""
        kind = "tp > 1" if tp > 1 else "pp > 1" if pp > 1 else "tp = pp = 1"
        kinds.setdefault(kind, Counter())[problem] += 1
    order = [k for k in ("tp > 1", "pp > 1", "tp = pp = 1") if k in kinds]
    return "none: " + "; ".join(f"{kind}: {kinds[kind].most_common(1)[0][0]}" for kind in order)


def degrees_text(lay: Layout) -> str:
    """``dp×sh×tp×pp`` with ``cpN`` (and the all-to-all mode) and ``sp`` where they apply."""
    cp = f" cp{lay.cp}" + (" ulysses" if lay.cp_mode == "ulysses" else "") if lay.cp > 1 else ""
    return f"{lay.dp}×{lay.sharding}×{lay.tp}×{lay.pp}{cp}{' sp' if lay.sequence_parallel else ''}"


def table(results: list[Validation]) -> str:
    lines = [
        "| run | source | layout (dp×sh×tp×pp [cp], micro-batch) | devices | published tok/s/device | predicted | pred/pub | fits (GiB) "
        "| strategy=auto instead | auto's prediction tok/s/device |",
        "|---|---|---|---|---:|---:|---:|---|---|---:|",
    ]
    for r in results:
        lay, c = r.published.layout, r.published
        auto = r.auto.chosen if r.auto else None
        auto_text = (f"{degrees_text(auto.layout)}, "
                     f"micro-batch {auto.layout.micro_batch}×{auto.layout.micro_steps}"
                     f"{f' v{auto.layout.virtual_stages}' if auto.layout.pp > 1 and auto.layout.virtual_stages > 1 else ''}"
                     f"{', recompute=' + r.auto.workload.recompute if r.auto.workload.recompute != r.run['recompute'] else ''}"
                     if auto else r.auto_note)
        lines.append(
            f"| {r.name} | [{r.run['source'].split(',')[0]}]({r.run['url']}) | {degrees_text(lay)}, {lay.micro_batch}"
            f"{f'×{lay.micro_steps}' if lay.micro_steps > 1 else ''}{f' v{lay.virtual_stages}' if lay.virtual_stages > 1 else ''} "
            f"| {lay.world:,} × {r.hardware.name} "
            f"| {r.published_tokens_per_s:,.1f} | {c.tokens_per_s_per_device:,.1f} | {r.ratio:.2f} | {'yes' if c.fits else 'NO'} "
            f"({c.memory['total'] / 2**30:.1f} of {r.hardware.usable_memory / 2**30:.1f}) | {auto_text} | "
            + (f"{auto.tokens_per_s_per_device:,.1f} |" if auto else "— |")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or list(runs())
    all_runs = runs()
    results = [validate(n, all_runs[n]) for n in names]
    print(table(results))
    for r in results:
        t = r.published.time
        print(
            f"{r.name}: step {t.total:.3g} s = compute {t.compute:.3g} (recompute {t.recompute:.3g}) + bubble {t.bubble:.3g} + "
            + " + ".join(f"{k} {v:.3g}" for k, v in t.comm.items() if v)
            + f" + FSDP copy-out {t.fsdp_copy:.3g} + optimizer {t.optimizer:.3g} + host {t.host:.3g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
