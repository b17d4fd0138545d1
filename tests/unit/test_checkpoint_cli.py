"""``python -m parallelkit.checkpoint`` on synthetic checkpoints: convert is exact and its memory is bounded by the
largest tensor, not the sum (measured as the max-RSS growth of a subprocess, against a plain torch.load+save of the
same checkpoint as the negative control); bad inputs exit 2 with a message naming the path and what would work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MIB = 1 << 20
N_PARAMS, PARAM_MIB = 20, 4  # 20 params × (weight + 2 Adam moments) × 4 MiB = 240 MiB of tensors, largest 4 MiB


def lightning_checkpoint(path: Path) -> dict:
    torch.manual_seed(0)
    names = [f"model.layers.{i}.weight" for i in range(N_PARAMS)]
    rows = PARAM_MIB * MIB // 4 // 256
    state = {n: torch.randn(rows, 256) for n in names}
    adam = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(rows, 256), "exp_avg_sq": torch.rand(rows, 256)} for i in range(N_PARAMS)}
    checkpoint = {"epoch": 0, "global_step": 3, "state_dict": state, "loops": {"fit_loop": {"x": 1}}, "callbacks": {},
                  "optimizer_states": [{"state": adam, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": list(range(N_PARAMS))}]}],
                  "lr_schedulers": [{"last_epoch": 3}]}
    torch.save(checkpoint, path)
    return checkpoint


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallelkit.checkpoint", *args], check=False, capture_output=True, text=True, timeout=300)


def peak_growth_mib(code: str) -> float:
    """Peak-RSS growth (MiB) of a fresh process while it runs ``code`` (after torch and parallelkit are imported).

    The peak is the kernel's VmHWM, reset to the current RSS first (``/proc/self/clear_refs``): ``ru_maxrss`` would
    carry this test process's own peak across the fork."""
    script = ("import json, torch, torch.distributed.checkpoint, torch.distributed.checkpoint.state_dict_loader\n"
              "import parallelkit.checkpoint.cli as cli, parallelkit.checkpoint.writers\n"
              "def kib(field): return int(open('/proc/self/status').read().split(field + ':')[1].split()[0])\n"
              "open('/proc/self/clear_refs', 'w').write('5')\n"
              "before = kib('VmRSS')\n" + code +
              "\nprint(json.dumps((kib('VmHWM') - before) / 1024))")
    # A fixed mmap threshold: freed tensors go back to the kernel, so the peak shows what the code holds at once
    # rather than what glibc's growing threshold keeps cached for reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_convert_file_to_sharded_and_back_is_exact_with_bounded_memory(tmp_path):
    source = tmp_path / "source.ckpt"
    original = lightning_checkpoint(source)
    total = sum(t.nbytes for t in original["state_dict"].values()) + sum(
        t.nbytes for s in original["optimizer_states"][0]["state"].values() for t in s.values()
    )
    largest = PARAM_MIB * MIB
    # Negative control: the measure sees a whole-checkpoint load (this is what bounded memory avoids).
    whole = peak_growth_mib(f"torch.save(torch.load({str(source)!r}, weights_only=False), {str(tmp_path / 'copy.ckpt')!r})")
    assert whole >= 0.9 * total / MIB, whole
    sharded = tmp_path / "sharded"
    to_sharded = peak_growth_mib(f"cli.convert({str(source)!r}, {str(sharded)!r}, ['strategy=tp'])")
    back = tmp_path / "back.ckpt"
    to_file = peak_growth_mib(f"cli.convert({str(sharded)!r}, {str(back)!r}, ['strategy=single'])")
    bound = 4 * largest / MIB + 24  # a tensor read, its copy on the way out, and allocator slack — not the 240 MiB sum
    assert to_sharded <= bound and to_file <= bound, (to_sharded, to_file, bound, total / MIB)
    assert (sharded / "meta.pt").is_file()

    from parallelkit.distributed.checkpoint_io import load_unsharded

    for converted in (load_unsharded(back), ):
        assert converted["global_step"] == 3 and converted["loops"] == original["loops"]
        for name, tensor in original["state_dict"].items():
            assert torch.equal(converted["state_dict"][name], tensor), name
        got, want = converted["optimizer_states"][0], original["optimizer_states"][0]
        assert got["param_groups"] == want["param_groups"]
        for i, entries in want["state"].items():
            for key, value in entries.items():
                assert torch.equal(got["state"][i][key], value), (i, key)
    via_dcp = load_unsharded(sharded)
    assert torch.equal(via_dcp["state_dict"]["model.layers.3.weight"], original["state_dict"]["model.layers.3.weight"])
    assert torch.equal(via_dcp["optimizer_0"]["state"]["model.layers.3.weight"]["exp_avg"], original["optimizer_states"][0]["state"][3]["exp_avg"])


def test_inspect_lists_every_tensor_with_all(tmp_path):
    lightning_checkpoint(tmp_path / "c.ckpt")
    done = cli("inspect", str(tmp_path / "c.ckpt"), "--all")
    assert done.returncode == 0, done.stderr
    assert "step:       3" in done.stdout and "one file" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if "model.layers." in line]
    assert len(rows) == 4 * N_PARAMS  # the weight, Adam's step and two moments of each parameter
    assert ["state_dict.model.layers.7.weight", "[4096,", "256]", "float32", str(PARAM_MIB * MIB)] in rows
    assert f"{(3 * N_PARAMS * PARAM_MIB * MIB + 4 * N_PARAMS)} bytes" in done.stdout


@pytest.mark.parametrize("case", ["missing", "half_written", "not_a_checkpoint", "no_strategy", "exists"])
def test_bad_input_exits_2_naming_the_problem(case, tmp_path):
    source = tmp_path / "c.ckpt"
    if case == "missing":
        done, expect = cli("inspect", str(tmp_path / "nope.ckpt")), "does not exist"
    elif case == "half_written":
        half = tmp_path / "last.ckpt"
        half.mkdir()
        (half / "__0_0.distcp").write_bytes(b"partial")
        done, expect = cli("inspect", str(half)), "no meta.pt"
    elif case == "not_a_checkpoint":
        source.write_text("hello")
        done, expect = cli("convert", str(source), str(tmp_path / "o"), "strategy=single"), "not a readable checkpoint file"
    elif case == "no_strategy":
        lightning_checkpoint(source)
        done, expect = cli("convert", str(source), str(tmp_path / "o")), "convert needs strategy=NAME"
    else:
        lightning_checkpoint(source)
        done, expect = cli("convert", str(source), str(source), "strategy=single"), "already exists"
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert expect in done.stderr and "Traceback" not in done.stderr, done.stderr
