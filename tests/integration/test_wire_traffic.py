"""Counted traffic = sent traffic: for every strategy and communication callback, the bytes parallelkit counts
per training step (``summary.json`` ``comm_by_rank``) agree, rank by rank, with the bytes each process handed
to the kernel's write calls (``/proc/self/io`` ``wchar``, ``os_bytes_written``) within ±5 %.

Each case runs ``train.py`` twice, for N and 2N steps, everything else equal: no validation, one checkpoint
at the end (the same files in both runs), so start-up, checkpoint and summary writes cancel in the
difference, which is N training steps' traffic (plus rank 0's few metrics.csv rows). Negative controls: the
count the issue measured for sequence parallel (gloo's reduce-scatter taken at the ideal (t−1)/t) fails the
same check; and validation, counted apart, is absent from the training figure yet present on the wire.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train import TINY, run_ok

STEPS = 5  # N; the second run trains 2N
TOLERANCE = 0.05
CTR = ["model=ctr", "data=ctr", "optim=adagrad", "data.rows_per_field=1000", "data.num_samples=20000",
       "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]

CASES = {
    "ddp": [*TINY, "strategy=ddp", "trainer.devices=2"],
    "ddp_fp16": [*TINY, "strategy=ddp_fp16", "trainer.devices=2"],
    "zero1": [*TINY, "strategy=zero", "strategy.stage=1", "trainer.devices=2"],
    "zero2": [*TINY, "strategy=zero", "strategy.stage=2", "trainer.devices=2"],
    "zero3": [*TINY, "strategy=zero", "strategy.stage=3", "trainer.devices=2"],
    "deepspeed_stage2": [*TINY, "strategy=deepspeed", "strategy.stage=2", "trainer.devices=2"],  # all-reduced buckets
    "deepspeed_stage3": [*TINY, "strategy=deepspeed", "strategy.stage=3", "trainer.devices=2"],  # reduce-scatter by all-to-all
    "tp": [*TINY, "strategy=tp", "strategy.tp=2", "trainer.devices=2"],
    "tp_sequence_parallel": [*TINY, "strategy=tp", "strategy.tp=2", "strategy.sequence_parallel=true", "trainer.devices=2"],
    "pp": [*TINY, "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"],
    "moe": [*TINY, "model=moe_gpt", "strategy=moe", "strategy.ep=2", "trainer.devices=2"],
    "hybrid4d": [*TINY, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "trainer.devices=4"],
    # sequence-sharded bf16 hand-offs between stages and SP's collectives at once
    "hybrid4d_sp_bf16": [*TINY, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "strategy.sequence_parallel=true",
                         "trainer.precision=bf16-mixed", "trainer.devices=4"],
    # TensorPipe between processes of one host uses shared memory, which no write call sees: over TCP here,
    # as between hosts. Its framing (about 0.5 KiB per request) is not counted: ~1.5 % of a worker's bytes.
    "ps": [*CTR, "strategy=ps", "trainer.devices=3", "strategy.rpc_transports=[uv]", "strategy.rpc_channels=[basic]"],
    # compressed from the start, at the final 99.9 % from step 4 on: the measured steps send top-k pairs only;
    # n_embd 256 (1.6 M parameters) so that they outweigh rank 0's metrics.csv rows (~100 bytes a step)
    "dgc": [*TINY, "model.n_embd=256", "callbacks=[dgc]", "optim=sgd", "callbacks.dgc.rampup_steps=4", "trainer.devices=2"],
    "local_sgd": [*TINY, "callbacks=[local_sgd]", "optim=sgd", "trainer.devices=2"],
    "hierarchical_allreduce": [*TINY, "callbacks=[hierarchical_allreduce]", "callbacks.hierarchical_allreduce.local_size=2", "trainer.devices=4"],
    "powersgd": [*TINY, "callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd",
                 "callbacks.grad_compression.start_iter=2", "trainer.devices=2"],  # compressing in the measured steps
}


# One checkpoint, at the end, in both runs; no time-based checkpoints and no stop-on-signal, so the ranks do not
# agree every few seconds (an all-reduce whose count would depend on the run's duration, not its steps).
CHECKPOINTS = ["checkpoint.every_n_minutes=0", "checkpoint.on_signal=false", "checkpoint.save_top_k=1"]


def run(args: list[str], steps: int, run_dir: Path, validate: bool = False) -> dict:
    """A run of ``steps`` steps whose only periodic writes are its steps' (checkpoint at the end only)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    validation = [] if validate else ["trainer.limit_val_batches=0"]
    return run_ok([*args, f"trainer.max_steps={steps}", *validation, f"checkpoint.every_n_steps={steps}", *CHECKPOINTS], run_dir)


def per_step(short: dict, long: dict) -> list[tuple[float, float]]:
    """Per rank, (counted, written) bytes per step over the steps the long run has beyond the short one."""
    a, b = short["comm_by_rank"], long["comm_by_rank"]
    steps = b["steps"] - a["steps"]
    assert steps == STEPS, (a["steps"], b["steps"])
    return [
        ((b["bytes_sent_per_step"][r] * b["steps"] - a["bytes_sent_per_step"][r] * a["steps"]) / steps,
         (b["os_bytes_written"][r] - a["os_bytes_written"][r]) / steps)
        for r in range(len(b["os_bytes_written"]))
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The N- and 2N-step summaries of a case, run once per module."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(name: str) -> tuple[dict, dict]:
        if name not in cache:
            base = tmp_path_factory.mktemp(name)
            cache[name] = (run(CASES[name], STEPS, base / "short"), run(CASES[name], 2 * STEPS, base / "long"))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_counted_bytes_per_step_match_the_bytes_written(runs, name):
    short, long = runs(name)
    wire = per_step(short, long)
    assert len(wire) == len(long["comm_by_rank"]["os_bytes_written"]) > 1
    for rank, (counted, written) in enumerate(wire):
        assert counted > 0, (name, rank, wire)
        assert abs(written / counted - 1) <= TOLERANCE, f"{name} rank {rank}: counted {counted:,.0f} B/step, wrote {written:,.0f} B/step"
    # summary.json's comm.bytes_sent_per_step is rank 0's count, as comm_by_rank says
    assert long["comm"]["bytes_sent_per_step"] == pytest.approx(long["comm_by_rank"]["bytes_sent_per_step"][0])


def test_negative_control_the_ideal_reduce_scatter_count_fails_the_check(runs):
    """The count the issue measured: gloo's reduce-scatter (an all-reduce of the whole input, 2(t−1)/t of it on
    the wire) taken at the ring's (t−1)/t, i.e. half, as the counter did. The same comparison rejects it."""
    short, long = runs("tp_sequence_parallel")
    kinds = long["comm"]["by_kind"]
    scatter = sum(v["bytes_per_step"] for k, v in kinds.items() if k.endswith("reduce_scatter"))
    assert scatter > 0
    (counted, written), *_ = per_step(short, long)
    ideal = counted - scatter / 2
    assert abs(written / counted - 1) <= TOLERANCE
    assert written / ideal - 1 > 3 * TOLERANCE, (counted, ideal, written)


def test_validation_is_counted_apart_from_the_training_steps(runs, tmp_path):
    """The pipeline validates through its schedule (point-to-point sends): with validation every 2 steps the
    training figure is the same as without, the validation bytes are reported apart, and counted training
    plus counted validation is what the processes wrote."""
    args = [*CASES["pp"], "trainer.val_check_interval=2", "trainer.limit_val_batches=2"]
    short, long = run(args, STEPS - 1, tmp_path / "short", validate=True), run(args, 2 * STEPS - 2, tmp_path / "long", validate=True)
    _, plain = runs("pp")
    assert long["comm"]["bytes_sent_per_step"] == pytest.approx(plain["comm"]["bytes_sent_per_step"], rel=0.01)
    validation = [b - a for a, b in zip(short["comm_by_rank"]["validation_bytes_sent"], long["comm_by_rank"]["validation_bytes_sent"])]
    # Forward only: the first stage sends the activations; the last one announces its receives and the loss.
    assert validation[0] > 0.3 * plain["comm"]["bytes_sent_per_step"] and validation[1] > 0, validation
    for rank in range(2):
        train = long["comm_by_rank"]["bytes_sent_per_step"][rank] * long["steps"] - short["comm_by_rank"]["bytes_sent_per_step"][rank] * short["steps"]
        written = long["comm_by_rank"]["os_bytes_written"][rank] - short["comm_by_rank"]["os_bytes_written"][rank]
        assert abs(written / (train + validation[rank]) - 1) <= TOLERANCE, (rank, train, validation, written)
    # negative control: on the rank that sends the activations, the training count alone misses the validation
    assert written_by(long, 0) - written_by(short, 0) > (1 + TOLERANCE) * (
        long["comm_by_rank"]["bytes_sent_per_step"][0] * long["steps"] - short["comm_by_rank"]["bytes_sent_per_step"][0] * short["steps"])
    assert long["comm_validation"]["bytes_sent"] == long["comm_by_rank"]["validation_bytes_sent"][0] > 0


def written_by(summary: dict, rank: int) -> int:
    return summary["comm_by_rank"]["os_bytes_written"][rank]
