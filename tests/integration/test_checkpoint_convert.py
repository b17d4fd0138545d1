"""``python -m parallelkit.checkpoint`` on real runs (issue 33, item 3): ``inspect`` names the layout of a one-process
file, a tp directory and a pp directory; ``convert`` turns a pipeline's sharded directory into one file that
``strategy=single`` continues exactly as its own uninterrupted 20-step run (computed here), and into a sharded
directory that ``strategy=tp`` continues the same way. Negative control: the converted file with Adam's state
dropped misses the reference by far, so the comparison sees the optimizer state the conversion carried. A DeepSpeed
directory converts to one file whose parameters are DeepSpeed's own reconstruction and whose moments its partitions'.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_train import REL_TOL, TINY, max_rel_diff, run_ok

BASE = [*TINY, "trainer.limit_val_batches=0"]
PP = ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"]
TP = ["strategy=tp", "strategy.tp=2", "trainer.devices=2"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallelkit.checkpoint", *args], check=False, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert")
    out = {"reference": run_ok([*BASE, "strategy=single"], root / "single20")}
    out["single_ckpt"] = root / "single20" / "checkpoints" / "last.ckpt"
    for name, layout in (("pp", PP), ("tp", TP)):
        run_ok([*BASE, *layout, "trainer.max_steps=10"], root / name)
        out[f"{name}_ckpt"] = root / name / "checkpoints" / "last.ckpt"
    return out


def test_inspect_names_the_layout_of_a_file_a_tp_and_a_pp_directory(runs):
    expected = {"single_ckpt": ("one file", "step:       20", "SingleStrategy"),
                "tp_ckpt": ("tensor parallel, degree 2", "step:       10", "tp': 2"),
                "pp_ckpt": ("pipeline parallel (2 per-stage optimizer group sets", "step:       10", "'pp': 2")}
    for key, needles in expected.items():
        done = cli("inspect", str(runs[key]))
        assert done.returncode == 0, done.stderr[-3000:]
        for needle in needles:
            assert needle in done.stdout, (key, needle, done.stdout)
        assert "tensors:    148," in done.stdout  # 37 parameters, each with Adam's step and two moments
        assert "loads into: single, ddp" in done.stdout and "deepspeed stage 1/2/3" in done.stdout


def test_pp_directory_converted_to_one_file_continues_under_single_exactly(runs, tmp_path):
    converted = tmp_path / "from_pp.ckpt"
    done = cli("convert", str(runs["pp_ckpt"]), str(converted), "strategy=single")
    assert done.returncode == 0, done.stderr[-3000:]
    assert converted.is_file()
    checkpoint = torch.load(converted, weights_only=False)
    assert "optimizer_states" in checkpoint and not any(k.startswith("optimizer_0") for k in checkpoint)  # the one-process layout
    run = run_ok([*BASE, "strategy=single", f"ckpt_path={converted}"], tmp_path / "run")
    reference = runs["reference"]["train_loss"]
    assert len(run["train_loss"]) == 20
    assert max_rel_diff(reference[10:], run["train_loss"][10:]) <= REL_TOL, (reference[10:], run["train_loss"][10:])

    for state in checkpoint["optimizer_states"]:  # negative control: the same file without Adam's state
        state["state"] = {}
    torch.save(checkpoint, tmp_path / "no_adam.ckpt")
    control = run_ok([*BASE, "strategy=single", f"ckpt_path={tmp_path / 'no_adam.ckpt'}"], tmp_path / "control")
    assert max_rel_diff(reference[10:], control["train_loss"][10:]) > 100 * REL_TOL


def test_file_converted_to_a_sharded_directory_continues_under_tp(runs, tmp_path):
    one_file = tmp_path / "from_pp.ckpt"
    assert cli("convert", str(runs["pp_ckpt"]), str(one_file), "strategy=single").returncode == 0
    sharded = tmp_path / "sharded"
    done = cli("convert", str(one_file), str(sharded), *TP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (sharded / "meta.pt").is_file() and (sharded / ".metadata").is_file()
    run = run_ok([*BASE, *TP, f"ckpt_path={sharded}"], tmp_path / "run")
    reference = runs["reference"]["train_loss"]
    assert max_rel_diff(reference[10:], run["train_loss"][10:]) <= REL_TOL, (reference[10:], run["train_loss"][10:])


def test_half_written_run_directory_exits_2(runs, tmp_path):
    """A copy of the tp directory without meta.pt (its writer died before the last file): refused, with the reason."""
    import shutil

    half = tmp_path / "last.ckpt"
    shutil.copytree(runs["tp_ckpt"], half)
    (half / "meta.pt").unlink()
    for args in (("inspect", str(half)), ("convert", str(half), str(tmp_path / "o.ckpt"), "strategy=single")):
        done = cli(*args)
        assert done.returncode == 2 and "incomplete sharded checkpoint (no meta.pt" in done.stderr, done.stderr


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_deepspeed_directory_is_inspected_and_converted_to_its_parameters_and_adam_state(stage, runs, tmp_path):
    """The conversion's parameters equal DeepSpeed's own reconstruction (``zero_to_fp32``); at stage 2 its Adam moments
    equal the partitions decoded a second way, by the per-rank ``param_slice_mappings`` DeepSpeed records; the file
    continues under ``strategy=single`` as the uninterrupted run."""
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run_ok([*BASE, "strategy=deepspeed", f"strategy.stage={stage}", "trainer.devices=2", "trainer.max_steps=10"], tmp_path / "ds")
    ckpt = tmp_path / "ds" / "checkpoints" / "last.ckpt"
    done = cli("inspect", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    for needle in (f"strategy=deepspeed, ZeRO stage {stage}, data parallel 2", "step:       10", "2 ZeRO partition files", "deepspeed stage 1/2/3"):
        assert needle in done.stdout, (needle, done.stdout)
    converted = tmp_path / "from_ds.ckpt"
    done = cli("convert", str(ckpt), str(converted), "strategy=single")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(converted, weights_only=False)
    expected = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="checkpoint")
    assert set(expected) <= set(checkpoint["state_dict"])
    for name, tensor in expected.items():
        assert torch.equal(checkpoint["state_dict"][name], tensor), name
    names = list(checkpoint["state_dict"])
    moments = {names[i]: s for i, s in checkpoint["optimizer_states"][0]["state"].items()}
    if stage == 2:
        pieces: dict[str, list] = {}
        for rank in (0, 1):
            part = torch.load(ckpt / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
            exp_avg = part["base_optimizer_state"]["state"][0]["exp_avg"]
            for name, fragment in part["param_slice_mappings"][0].items():
                pieces.setdefault(name, []).append(exp_avg[fragment.start:fragment.start + fragment.numel])
        for name, parts in pieces.items():
            assert torch.equal(torch.cat(parts), moments[name]["exp_avg"].reshape(-1)), name
        assert len(pieces) == len(expected)
    run = run_ok([*BASE, "strategy=single", f"ckpt_path={converted}"], tmp_path / "run")
    reference = runs["reference"]["train_loss"]
    assert max_rel_diff(reference[10:], run["train_loss"][10:]) <= REL_TOL, (reference[10:], run["train_loss"][10:])
    refused = cli("convert", str(ckpt), str(tmp_path / "o"), "strategy=deepspeed")
    assert refused.returncode == 2 and "continues from any checkpoint as it is" in refused.stderr, refused.stderr
    assert not (tmp_path / "o").exists()


INTERLEAVED = ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "strategy.schedule=interleaved_1f1b", "trainer.devices=2"]
MOE = ["model=moe_gpt", "model.num_experts=4", "model.top_k=2", "model.capacity_factor=2.0"]  # no token dropped


@pytest.mark.slow
@pytest.mark.parametrize("source", ["interleaved_pp", "ep2"])
def test_stage_and_expert_grouped_directories_convert_to_one_file_and_a_sharded_directory(source, tmp_path):
    """An interleaved schedule's ranks save groups of two stages each, expert parallel ranks their own experts' groups:
    their lists lose the single-device order a one-file checkpoint numbers the optimizer state by, which the model
    records in every checkpoint. The converted file continues under ``strategy=single`` exactly as the directory itself
    does (read whole by one process), and within tolerance of single's own uninterrupted run; the sharded conversion
    under tp as the directory does, bit for bit. Negative control: the directory without the recorded order is refused
    (``not yet convertible``), as every directory written before the order was recorded."""
    import shutil

    small = [*BASE, "model.n_layer=4", *(MOE if source == "ep2" else [])]
    layout = INTERLEAVED if source == "interleaved_pp" else ["strategy=moe", "strategy.ep=2", "trainer.devices=2"]
    reference = run_ok([*small, "strategy=single", "trainer.max_steps=14"], tmp_path / "single")
    run_ok([*small, *layout, "trainer.max_steps=7"], tmp_path / "src")
    ckpt = tmp_path / "src" / "checkpoints" / "last.ckpt"
    one_file = tmp_path / "one.ckpt"
    done = cli("convert", str(ckpt), str(one_file), "strategy=single")
    assert done.returncode == 0, done.stderr[-3000:]
    direct = run_ok([*small, "strategy=single", "trainer.max_steps=14", f"ckpt_path={ckpt}"], tmp_path / "direct")
    converted = run_ok([*small, "strategy=single", "trainer.max_steps=14", f"ckpt_path={one_file}"], tmp_path / "converted")
    assert converted["train_loss"] == direct["train_loss"]
    assert max_rel_diff(reference["train_loss"][7:], converted["train_loss"][7:]) <= REL_TOL, (reference["train_loss"], converted["train_loss"])
    if source == "interleaved_pp":
        done = cli("convert", str(ckpt), str(tmp_path / "sharded"), *TP)
        assert done.returncode == 0, done.stderr[-3000:]
        direct = run_ok([*small, *TP, "trainer.max_steps=14", f"ckpt_path={ckpt}"], tmp_path / "tp_direct")
        converted = run_ok([*small, *TP, "trainer.max_steps=14", f"ckpt_path={tmp_path / 'sharded'}"], tmp_path / "tp_converted")
        assert converted["train_loss"] == direct["train_loss"]
    old = tmp_path / "old.ckpt"  # negative control: as written before the order was recorded
    shutil.copytree(ckpt, old)
    meta = torch.load(old / "meta.pt", weights_only=False)
    del meta["parallelkit_param_order"]
    torch.save(meta, old / "meta.pt")
    refused = cli("convert", str(old), str(tmp_path / "old_one.ckpt"), "strategy=single")
    assert refused.returncode == 2 and "not yet convertible to one file" in refused.stderr, refused.stderr
    assert not (tmp_path / "old_one.ckpt").exists()
