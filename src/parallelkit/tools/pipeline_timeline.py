"""Draw a recorded pipeline schedule: a Gantt chart (PNG) and a Chrome trace (JSON).

``python train.py strategy=pp strategy.trace=true ...`` leaves ``DIR/pipeline_trace/rank*.json`` (the
start/end of every forward, backward and send/recv wait on every rank); then::

    python -m parallelkit.tools.pipeline_timeline DIR            # the last traced step
    python -m parallelkit.tools.pipeline_timeline DIR --step 3

writes ``DIR/pipeline_timeline.png`` (rank × time, forward/backward coloured, idle time blank: the
bubble) and ``DIR/pipeline_chrome_trace.json`` (open in chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TRACE_DIR = "pipeline_trace"
COLORS = {"F": "#4C78A8", "L": "#72B7B2", "B": "#54A24B", "I": "#F58518", "W": "#B279A2"}
NAMES = {"F": "forward", "L": "loss (last stage)", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def load_traces(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's trace record, by rank."""
    folder = run_dir / TRACE_DIR if (run_dir / TRACE_DIR).is_dir() else run_dir
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise SystemExit(f"No pipeline trace in {folder}: run with strategy=pp strategy.trace=true first.")
    return [json.loads(f.read_text()) for f in files]


def step_events(traces: list[dict[str, Any]], step: int) -> tuple[dict[int, list[dict]], float]:
    """Events of one step per rank, times in ms from the step's first event on any rank."""
    per_rank = {}
    for t in traces:
        steps = t["steps"]
        if not -len(steps) <= step < len(steps):
            raise SystemExit(f"Rank {t['rank']} traced {len(steps)} step(s); --step {step} is out of range.")
        per_rank[t["rank"]] = steps[step]
    origin = min(e["start"] for events in per_rank.values() for e in events)
    shifted = {r: [{**e, "start": (e["start"] - origin) * 1e3, "end": (e["end"] - origin) * 1e3} for e in events] for r, events in per_rank.items()}
    return shifted, origin


def bubble_by_rank(per_rank: dict[int, list[dict]]) -> dict[int, float]:
    """Idle share of each rank over the step (first start to last end, over all ranks)."""
    span = max(e["end"] for events in per_rank.values() for e in events)
    return {r: 1.0 - sum(e["end"] - e["start"] for e in events if e["kind"] in COLORS) / span for r, events in per_rank.items()}


def chrome_trace(per_rank: dict[int, list[dict]], traces: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {t["rank"]: t for t in traces}
    events: list[dict[str, Any]] = []
    for rank, items in per_rank.items():
        m = meta[rank]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} (pp {m['pp_rank']}, dp {m['dp_rank']})"}})
        for e in items:
            compute = e["kind"] in COLORS
            name = f"{e['kind']}{e['mb']} s{e['stage']}" if compute else e["label"]
            events.append({"ph": "X", "name": name, "cat": NAMES.get(e["kind"], "wait"), "pid": rank, "tid": 0 if compute else 1,
                           "ts": e["start"] * 1e3, "dur": (e["end"] - e["start"]) * 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw(per_rank: dict[int, list[dict]], traces: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("Drawing the timeline needs matplotlib: pip install -e '.[dev]' (or pip install matplotlib).") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(per_rank)
    bubbles = bubble_by_rank(per_rank)
    span = max(e["end"] for events in per_rank.values() for e in events)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(ranks) + 1.6))
    for row, rank in enumerate(ranks):
        for e in per_rank[rank]:
            width = e["end"] - e["start"]
            if e["kind"] in COLORS:
                ax.barh(row, width, left=e["start"], height=0.8, color=COLORS[e["kind"]], edgecolor="white", linewidth=0.5)
                if width > span / 60:
                    ax.text(e["start"] + width / 2, row, f"{e['mb']}" + (f"·s{e['stage']}" if len(traces[0]["stage_ids"]) > 1 else ""),
                            ha="center", va="center", color="white", fontsize=7)
            else:  # waiting on a send/recv: a thin grey bar under the row
                ax.barh(row + 0.32, width, left=e["start"], height=0.12, color="#999999")
    meta = {t["rank"]: t for t in traces}
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (pp {meta[r]['pp_rank']})\nbubble {bubbles[r]:.0%}" for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title, fontsize=10)
    kinds = sorted({e["kind"] for events in per_rank.values() for e in events if e["kind"] in COLORS}, key="FLBIW".index)
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds] + [Patch(color="#999999", label="waiting on send/recv")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(ranks) < 4 else -0.1), ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(run_dir: Path, step: int = -1, out: Path | None = None) -> dict[str, Any]:
    """Write the PNG and the Chrome trace for ``step``; return the paths and the per-rank bubble."""
    traces = load_traces(run_dir)
    per_rank, _ = step_events(traces, step)
    out = out or run_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = traces[0]
    title = (f"{t0['schedule']}: pp={t0['pp']}, micro-batches={t0['microbatches']}"
             + (f", virtual stages={t0['virtual_stages']}" if t0["virtual_stages"] > 1 else "")
             + f" — step {step if step >= 0 else len(t0['steps']) + step}")
    png, chrome = out / "pipeline_timeline.png", out / "pipeline_chrome_trace.json"
    draw(per_rank, traces, png, title)
    chrome.write_text(json.dumps(chrome_trace(per_rank, traces)))
    return {"png": str(png), "chrome_trace": str(chrome), "bubble_by_rank": bubble_by_rank(per_rank)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelkit.tools.pipeline_timeline", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory with pipeline_trace/ (strategy.trace=true)")
    parser.add_argument("--step", type=int, default=-1, help="which traced step (default: the last)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the run directory)")
    args = parser.parse_args(argv)
    result = render(args.run_dir, args.step, args.out)
    bubbles = ", ".join(f"rank {r}: {b:.1%}" for r, b in sorted(result["bubble_by_rank"].items()))
    print(f"wrote {result['png']} and {result['chrome_trace']} (bubble {bubbles})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
