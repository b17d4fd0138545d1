"""The user's own model through ``train.py``: an ``nn.Module`` of the user's package (``examples/user_package``)
with its own plans, picked from the user's config directory, against one process; and bad input about a
user's model (no plan, a target that does not import, a LightningModule a pipeline cannot run).

Every job runs in a copy of the example package, as a user runs from their project directory: the working
directory is importable (``mynet``), and ``hydra.searchpath=[file://.../my_conf]`` adds ``model=mynet``.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from test_train import REL_TOL, max_rel_diff, train

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "user_package"
SMALL = ["model=mynet", "model.n_blocks=2", "model.hidden=64", "model.width=32", "data.seq_len=16",
         "data.global_batch_size=8", "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The example package and its config directory, copied where a user would have them."""
    root = tmp_path_factory.mktemp("project")
    shutil.copytree(EXAMPLE / "mynet", root / "mynet")
    shutil.copytree(EXAMPLE / "my_conf", root / "my_conf")
    return root


def run_mine(project: Path, args: list[str], name: str, small: bool = True) -> tuple[int, str, Path]:
    run_dir = project / "outputs" / name
    proc = train([f"hydra.searchpath=[file://{project / 'my_conf'}]", *(SMALL if small else []), *args, f"hydra.run.dir={run_dir}"], cwd=project)
    return proc.returncode, proc.stderr, run_dir


def summary_of(project: Path, args: list[str], name: str) -> dict:
    import json

    small = not args or args[0] != "NO_SMALL"
    code, err, run_dir = run_mine(project, args if small else args[1:], name, small)
    assert code == 0, f"{args} exited {code}\n{err[-4000:]}"
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def single(project) -> dict:
    return summary_of(project, ["strategy=single"], "single")


@pytest.mark.parametrize("args", [["strategy=tp", "trainer.devices=2"], ["strategy=pp", "trainer.devices=2", "strategy.microbatches=2"]],
                         ids=["tp2", "pp2"])
def test_users_model_with_its_own_plan_matches_one_process(project, single, args):
    mine = summary_of(project, args, args[0].replace("=", "_"))
    assert mine["num_params"] == single["num_params"]
    assert max_rel_diff(mine["train_loss"], single["train_loss"]) <= REL_TOL
    assert mine["train_loss"][-1] < mine["train_loss"][0] - 0.3  # it trained
    kinds = mine["comm"]["by_kind"]
    if args[0] == "strategy=tp":  # the plan split the blocks: their MLP all-reduces were counted there
        assert mine["dims"]["tp"] == 2 and kinds["tp_block.all_reduce"]["bytes_per_step"] > 0
        # each rank holds half of every block's up/down weights: fewer parameter bytes than the whole model
        assert mine["model_state_bytes"]["params"] < single["model_state_bytes"]["params"]
    else:  # the plan cut the blocks into two stages: activations travel between them
        assert mine["dims"]["pp"] == 2 and mine["pipeline"]["stage_blocks"] == [[0, 1], [1, 2]]
        assert any(kind.startswith("pp") for kind in kinds), kinds


def test_plan_named_in_the_config(project, single, tmp_path):
    """The same plans in a module of another name, given with strategy.plan=...: the model's package has none."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(project, elsewhere, ignore=shutil.ignore_patterns("outputs"))
    (elsewhere / "mynet" / "parallelize.py").rename(elsewhere / "mynet" / "my_plans.py")
    without = run_mine(elsewhere, ["strategy=tp", "trainer.devices=2"], "no_plan")
    assert without[0] == 2 and "needs a tensor parallel plan for CharMLP" in without[1], without[1][-2000:]
    mine = summary_of(elsewhere, ["strategy=tp", "trainer.devices=2", "strategy.plan=mynet.my_plans"], "named_plan")
    assert max_rel_diff(mine["train_loss"], single["train_loss"]) <= REL_TOL


def test_negative_control_other_seed(project, single):
    other = summary_of(project, ["strategy=tp", "trainer.devices=2", "seed=5"], "other_seed")
    assert max_rel_diff(other["train_loss"], single["train_loss"]) > 1e-3


def test_logger_tensorboard_writes_events(project):
    """``logger=tensorboard``: event files in the run directory instead of metrics.csv, with the loss in them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mine = summary_of(project, ["strategy=single", "logger=tensorboard"], "tensorboard")
    run_dir = project / "outputs" / "tensorboard"
    assert not (run_dir / "metrics.csv").exists()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = [e.value for e in events.Scalars("train_loss")]
    assert logged == pytest.approx(mine["train_loss"], rel=1e-6)


LIGHTNING = textwrap.dedent('''
    import lightning.pytorch as pl
    import torch

    from mynet.model import CharMLP


    class LitCharMLP(pl.LightningModule):
        """The same network in a LightningModule of the user's: its own optimizer, schedule and logging."""

        def __init__(self, vocab_size, block_size):
            super().__init__()
            self.net = CharMLP(vocab_size, block_size, width=32, hidden=64, n_blocks=2)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = self.net.loss(self.net(inputs), targets)
            self.log("my_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)]
''')


@pytest.fixture(scope="module")
def lit_project(project) -> Path:
    (project / "mynet" / "lit.py").write_text(LIGHTNING)
    (project / "my_conf" / "model" / "lit.yaml").write_text("_target_: mynet.lit.LitCharMLP\n")
    (project / "my_conf" / "strategy").mkdir(exist_ok=True)
    (project / "my_conf" / "strategy" / "lightning_ddp.yaml").write_text(
        "# Lightning's own DDP strategy, not parallelkit's\n_target_: lightning.pytorch.strategies.DDPStrategy\n")
    return project


def test_lightning_module_through_hydra_under_zero3(lit_project):
    """``model=`` may build a LightningModule: it trains unchanged (its optimizer, schedule, logging)."""
    common = ["NO_SMALL", "model=lit", "data.seq_len=16", "data.global_batch_size=8", "trainer.max_steps=10"]
    one = summary_of(lit_project, [*common, "strategy=single"], "lit_single")
    zero3 = summary_of(lit_project, [*common, "strategy=zero", "strategy.stage=3", "trainer.devices=2"], "lit_zero3")
    assert max_rel_diff(zero3["train_loss"], one["train_loss"]) <= REL_TOL
    assert zero3["train_loss"][-1] < zero3["train_loss"][0] - 0.3
    # ZeRO-3 sharded it: each rank holds half of the parameters
    assert zero3["model_state_bytes"]["params"] * 2 == pytest.approx(one["model_state_bytes"]["params"], rel=0.01)


def test_a_lightning_strategy_that_is_not_parallelkits(lit_project):
    """``strategy=`` may build any Lightning strategy: it trains, with parallelkit's extras off (said once)."""
    import json

    common = ["model=lit", "data.seq_len=16", "data.global_batch_size=8", "trainer.max_steps=10"]
    one = summary_of(lit_project, ["NO_SMALL", *common, "strategy=single"], "lit_single_ref")
    run_dir = lit_project / "outputs" / "foreign"
    proc = train([f"hydra.searchpath=[file://{lit_project / 'my_conf'}]", *common, "strategy=lightning_ddp", "trainer.devices=2",
                  "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"], cwd=lit_project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is not a parallelkit strategy" in proc.stdout + proc.stderr
    foreign = json.loads((run_dir / "summary.json").read_text())
    assert foreign["strategy"] == "DDPStrategy" and foreign["world_size"] == 2  # its class: parallelkit's is "ddp"
    assert max_rel_diff(foreign["train_loss"], one["train_loss"]) <= REL_TOL
    assert foreign["comm"]["bytes_sent_per_step"] is None  # parallelkit did not count this strategy's traffic


MANUAL = textwrap.dedent('''
    import lightning.pytorch as pl
    import torch

    from mynet.model import CharMLP


    class ManualCharMLP(pl.LightningModule):
        """A LightningModule with manual optimization: it calls backward and step itself."""

        def __init__(self, vocab_size, block_size):
            super().__init__()
            self.automatic_optimization = False
            self.net = CharMLP(vocab_size, block_size, width=32, hidden=64, n_blocks=2)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = self.net.loss(self.net(inputs), targets)
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return loss.detach()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
''')


@pytest.mark.parametrize("case", ["no-plan", "no-import", "manual-pp", "optim-for-lightning-module"])
def test_bad_input_about_the_users_model(project, case, tmp_path):
    (project / "mynet" / "manual.py").write_text(MANUAL)
    (project / "my_conf" / "model" / "manual.yaml").write_text("_target_: mynet.manual.ManualCharMLP\n")
    args, words = {
        "no-plan": (["NO_SMALL", "model=mlp", "data=synthetic", "strategy=tp", "trainer.devices=2"],
                    ["strategy=tp with strategy.tp=2 needs a tensor parallel plan for MLP", "tensor_parallel_plan(model, tp, *, sequence_parallel)",
                     "strategy.plan=PATH", "parallelkit.models.mlp.parallelize"]),
        "no-import": (["model._target_=nosuchpkg.Net"], ["model._target_=nosuchpkg.Net does not import", "no module named 'nosuchpkg'"]),
        "manual-pp": (["NO_SMALL", "model=manual", "data.seq_len=16", "strategy=pp", "trainer.devices=2"],
                      ["strategy=pp cannot train ManualCharMLP", "manual optimization"]),
        "optim-for-lightning-module": (["NO_SMALL", "model=manual", "optim=sgd"],
                                       ["model=manual built a LightningModule (ManualCharMLP)", "optim=sgd cannot take effect"]),
    }[case]
    small = [] if "NO_SMALL" in args else SMALL
    run_dir = tmp_path / "run"
    proc = train([f"hydra.searchpath=[file://{project / 'my_conf'}]", *small, *(a for a in args if a != "NO_SMALL"),
                  f"hydra.run.dir={run_dir}"], cwd=project)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    message = proc.stderr.strip().splitlines()
    assert len([line for line in message if line.startswith("parallelkit: error:")]) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, f"{word!r} missing from:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    for produced in ("summary.json", "metrics.csv", "checkpoints"):
        assert not (run_dir / produced).exists(), produced
