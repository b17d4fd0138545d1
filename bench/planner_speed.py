"""How long a plan takes: the planner on worlds up to 16,384 ranks and models up to a trillion parameters.

For each case, the wall time of the whole command (``python -m parallelkit.plan strategy=auto ...``: interpreter,
Hydra, the workload, every candidate costed, the ranking printed) and of the search alone (in this process, after
the imports), with the number of candidates costed and pruned. The issue's bar: ≤ 10 s per plan on this machine.

    python bench/planner_speed.py          # ~1 min; writes bench/results/planner_speed.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "src" / "parallelkit" / "planner" / "published"
MEGATRON_1T = ["model=gpt", "model.n_layer=128", "model.n_embd=25600", "model.n_head=160", "+model.vocab_size=51200",
               "data.seq_len=2048", "data.global_batch_size=8192", "recompute=full"]
CASES = {
    "1T GPT, 16,384 H100 (interleaved 1F1B)": [*MEGATRON_1T, "trainer.devices=8", "trainer.num_nodes=2048", "strategy.hardware=h100_80gb_8x",
                                              "strategy.schedule=interleaved_1f1b"],
    "1T GPT, 16,384 H100 (1F1B, bf16-mixed)": [*MEGATRON_1T, "trainer.devices=8", "trainer.num_nodes=2048", "strategy.hardware=h100_80gb_8x",
                                              "trainer.precision=bf16-mixed"],
    "Llama 3 405B (HF config), 16,384 H100": ["model=hf", f"model.config={PUBLISHED / 'llama3_405b.json'}", "data.seq_len=8192",
                                             "data.global_batch_size=2048", "recompute=full", "trainer.devices=8", "trainer.num_nodes=2048",
                                             "strategy.hardware=h100_80gb_8x"],
    "GPT 834K (bench/hybrid.py), 8 CPU ranks": ["model=gpt", "data=chars", "trainer.devices=8"],
}


def main() -> None:
    from parallelkit.planner.auto import auto_plan_from_config
    from parallelkit.planner.inputs import compose_config

    results = {}
    for name, overrides in CASES.items():
        start = time.perf_counter()
        # --ranks-limit 0: the plan only (the per-rank dry run of small worlds is another feature, timed elsewhere)
        proc = subprocess.run([sys.executable, "-m", "parallelkit.plan", "strategy=auto", *overrides, "--ranks-limit", "0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        command_s = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        cfg = compose_config(["strategy=auto", *overrides])
        start = time.perf_counter()
        plan = auto_plan_from_config(cfg)
        search_s = time.perf_counter() - start
        results[name] = {"command_s": command_s, "plan_s": search_s, "candidates": len(plan.candidates),
                         "pruned_degree_sets": plan.invalid_layouts, "world": plan.world_size, "params": plan.num_params,
                         "chosen": plan.chosen.label}
        print(f"{name}: command {command_s:.2f} s, plan {search_s:.2f} s, {len(plan.candidates):,} candidates "
              f"({plan.invalid_layouts} degree sets pruned); chosen {plan.chosen.label}", flush=True)
    out = ROOT / "bench" / "results" / "planner_speed.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
