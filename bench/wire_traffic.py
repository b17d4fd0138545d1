"""Counted traffic against the bytes each process wrote, for every strategy and communication callback.

The runs of ``tests/integration/test_wire_traffic.py`` (its cases, N and 2N steps, no validation, one checkpoint
at the end), printed as the table of docs/traffic.md and saved to ``bench/results/wire_traffic.json``: per rank,
the bytes parallelkit counted per training step (``summary.json`` ``comm_by_rank``) and the bytes the process
handed to the kernel's write calls per step (``os_bytes_written``), from the difference of the two runs.

    python bench/wire_traffic.py                 # every case, ~1 min on 2 cores (warm launcher)
    python bench/wire_traffic.py --only tp,pp     # some of them
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from test_wire_traffic import CASES, STEPS, per_step, run  # noqa: E402 - importable once the path above is set


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated cases (default: all)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(CASES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            short = run(CASES[name], STEPS, Path(tmp) / name / "short")
            long = run(CASES[name], 2 * STEPS, Path(tmp) / name / "long")
            wire = per_step(short, long)
            rows.append({"case": name, "ranks": len(wire), "counted": [c for c, _ in wire], "written": [w for _, w in wire]})
            print(f"{name}: " + ", ".join(f"rank {r} counted {c:,.0f} wrote {w:,.0f} ({w / c:.4f})" for r, (c, w) in enumerate(wire)), flush=True)
    print("\n| run | ranks | counted B/step (rank 0) | written / counted, every rank |\n|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['case']} | {r['ranks']} | {r['counted'][0]:,.0f} | {', '.join(f'{w / c:.4f}' for c, w in zip(r['counted'], r['written']))} |")
    out = REPO / "bench" / "results" / "wire_traffic.json"
    if args.only and out.exists():  # re-measured some cases: keep the saved rows of the others
        rows += [r for r in json.loads(out.read_text())["rows"] if r["case"] not in names]
        rows.sort(key=lambda r: list(CASES).index(r["case"]) if r["case"] in CASES else len(CASES))
    out.write_text(json.dumps({"steps": STEPS, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
