"""The launcher decides whether the other local ranks may start now, and starts them, before torch is imported.

``train.py`` and ``python -m parallelkit`` start ranks 1..N-1 first thing when the command line's degrees fit N
processes (``parallelkit.launch.local_ranks.prepare_process``), so that every rank imports torch and Lightning at
the same time. Deciding must not import torch itself: it once did (``ParallelDims.resolve`` → the elastic
module's top-level ``import torch.distributed``), and every other rank started ~1.2 s after rank 0
(``bench/phases.py``: rank 1's process_start), which rank 0 then waited for at the rendezvous.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from parallelkit.launch.command_line import config_groups, degrees_allow_early_start, replace_groups_by_target
conf = {conf!r}

def allowed(args, n):
    return degrees_allow_early_start(conf, replace_groups_by_target(args, list(config_groups(conf))), n)

verdicts = [allowed(["strategy=tp", "strategy.tp=2", "trainer.devices=4"], 4),
            allowed(["strategy=tp", "strategy.tp=2", "trainer.devices=3"], 3),
            allowed(["strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "trainer.devices=8"], 8)]
before = "torch" in sys.modules
{then}
print(json.dumps([verdicts, before, "torch" in sys.modules]))
"""


def probe(then: str = "") -> list:
    code = textwrap.dedent(PROBE.format(conf=str(ROOT / "conf"), then=then))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deciding_the_early_start_imports_no_torch():
    verdicts, before, _ = probe()
    assert verdicts == [True, False, True]  # tp=2 fits 4 and 8 (with pp=2) processes, not 3
    assert before is False


def test_the_probe_sees_torch_once_something_imports_it():
    """The negative control: the same probe reports torch after a module that needs it is imported."""
    verdicts, before, after = probe("import parallelkit.distributed.elastic as e; e.init_process_group_for_attempt('gloo', None)")
    assert verdicts == [True, False, True] and before is False and after is True
