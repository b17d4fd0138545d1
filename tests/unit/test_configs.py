"""Every YAML under conf/ composes with ``train`` and instantiates (like lightning-hydra-template's test_configs).

The options are discovered from the files, so a new ``conf/GROUP/NAME.yaml`` is tested without editing
this file; a file in a group this test has no check for fails :func:`test_every_conf_file_is_covered`.
Nothing here starts a process group: strategies are only constructed and asked to plan.
"""

from __future__ import annotations

import inspect
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException
from hydra.utils import get_class, get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from parallelkit.launch.resolvers import register_resolvers, run_name

CONF_DIR = (Path(__file__).resolve().parents[2] / "conf").resolve()
PRIMARY = CONF_DIR / "train.yaml"


def option_files(conf_dir: Path = CONF_DIR) -> list[Path]:
    return sorted(p for p in conf_dir.rglob("*.yaml") if p != conf_dir / PRIMARY.name)


def group_and_name(path: Path, conf_dir: Path = CONF_DIR) -> tuple[str, str]:
    rel = path.relative_to(conf_dir)
    return rel.parent.as_posix(), rel.stem


def options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(name for g, name in (group_and_name(p, conf_dir) for p in option_files(conf_dir)) if g == group)


# Composition is deterministic and costs ~0.1 s; the same overrides are composed by several tests.
_COMPOSED: dict[tuple[str, tuple[str, ...]], DictConfig] = {}


def composer(conf_dir: Path = CONF_DIR):
    """``compose(overrides)`` → the composed ``train`` config, with HydraConfig set like @hydra.main does."""
    register_resolvers()

    def _compose(overrides: list[str] = ()) -> DictConfig:
        key = (str(conf_dir), tuple(overrides))
        if key not in _COMPOSED:
            with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
                _COMPOSED[key] = compose("train", overrides=list(overrides), return_hydra_config=True)
        cfg = _COMPOSED[key]
        HydraConfig.instance().set_config(cfg)
        return cfg

    _compose.conf_dir = conf_dir
    return _compose


@pytest.fixture
def compose_train():
    previous = HydraConfig.instance().cfg
    yield composer()
    HydraConfig.instance().cfg = previous


# --------------------------------------------------------------------------- what each group must build


def build_strategy(cfg: DictConfig) -> tuple[Any, Any]:
    from lightning.pytorch.strategies import Strategy

    from parallelkit.distributed.parallel_dims import ParallelDims

    strategy = instantiate(cfg.strategy)
    if hasattr(strategy, "resolve"):  # strategy=auto: a planner that resolves to the strategy it trains with
        strategy = strategy.resolve(cfg, strategy.default_devices("cpu"), 1)
    assert isinstance(strategy, Strategy)
    # The planning capability every parallelkit strategy offers (DESIGN §1), before any process starts.
    world = strategy.default_devices("cpu")
    dims = strategy.plan(world)
    assert isinstance(dims, ParallelDims) and dims.world_size == world
    hook = cfg.strategy.get("ddp_comm_hook")
    if isinstance(hook, DictConfig) and "_target_" in hook:
        # A configured comm hook reaches the strategy as the function the YAML names (a partial of it).
        built = strategy._ddp_comm_hook
        assert getattr(built, "func", built) is get_object(hook._target_)
    assert not dist.is_initialized(), "instantiating a strategy must not start a process group"
    return strategy, dims


def build_data(cfg: DictConfig, data_parallel_size: int = 1, accumulate: int = 1) -> Any:
    from parallelkit.data.base import DataParallelDataModule

    dm = instantiate(cfg.data)
    assert isinstance(dm, DataParallelDataModule)
    plan = dm.configure(data_parallel_size=data_parallel_size, accumulate=accumulate)
    if cfg.data.get("global_batch_size") is not None:
        assert plan.global_batch_size == cfg.data.global_batch_size
    assert len(dm.train_set) >= plan.global_batch_size and len(dm.val_set) > 0
    return dm


def accepts(target: str, kwargs: dict) -> bool:
    """Whether the class ``target`` takes every keyword in ``kwargs``."""
    params = inspect.signature(get_class(target)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return set(kwargs) <= set(params)


def build_model(cfg: DictConfig, dm: Any) -> torch.nn.Module:
    model = instantiate(cfg.model, **dm.model_kwargs())
    assert isinstance(model, torch.nn.Module)
    # One micro-batch of this data through the model and its loss.
    inputs, targets = (torch.stack(t) for t in zip(*(dm.train_set[i] for i in range(2))))
    loss = model.loss(model(inputs), targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    return model


def build_optim(cfg: DictConfig, model: torch.nn.Module) -> None:
    from parallelkit.models.module import TrainModule

    factory = instantiate(cfg.optim.optimizer)
    optimizer = factory(model.parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "the optimizer did not step"
    # The schedule keys are TrainModule's arguments (run.py passes them as **kwargs).
    schedule = OmegaConf.to_container(cfg.optim.schedule, resolve=True)
    module = TrainModule(model, factory, **schedule)
    configured = module.configure_optimizers()
    assert configured is not None


def build_callbacks(cfg: DictConfig) -> list:
    from lightning.pytorch import Callback

    built = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    assert all(isinstance(cb, Callback) for cb in built)
    return built


def build_trainer(cfg: DictConfig, tmp_path: Path, callbacks: list = ()) -> Any:
    """The trainer group as run.py uses it: Lightning Trainer keywords (with strategy etc. set by parallelkit)."""
    import lightning.pytorch as pl

    from parallelkit.run import resolve_accelerator
    from parallelkit.strategies import SingleStrategy

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert resolve_accelerator(kwargs.pop("accelerator", "auto")) in ("cpu", "gpu")
    devices = kwargs.pop("devices", None)
    assert devices is None or (isinstance(devices, int) and devices >= 1)
    num_nodes = kwargs.pop("num_nodes", 1)
    return pl.Trainer(
        strategy=SingleStrategy(),
        accelerator="cpu",
        devices=1,
        num_nodes=num_nodes,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
        **kwargs,
    )


def build_all(cfg: DictConfig, tmp_path: Path) -> None:
    """Everything run.py builds before ``fit``, in its order."""
    _, dims = build_strategy(cfg)
    dm = build_data(cfg, dims.data_parallel_size, cfg.trainer.accumulate_grad_batches)
    model = build_model(cfg, dm)
    build_optim(cfg, model)
    build_trainer(cfg, tmp_path, build_callbacks(cfg))


# --------------------------------------------------------------------------- one check per group


def check_strategy(name, compose_train, tmp_path):
    cfg = compose_train([f"strategy={name}"])
    assert cfg.hydra.runtime.choices.strategy == name
    build_strategy(cfg)


def check_data(name, compose_train, tmp_path):
    cfg = compose_train([f"data={name}"])
    dm = build_data(cfg)
    assert isinstance(dm.model_kwargs(), dict) and dm.model_kwargs()


def check_model(name, compose_train, tmp_path):
    """Build the model with every data option whose model_kwargs it takes; at least one must fit."""
    model_target = compose_train([f"model={name}"]).model._target_
    fitting = 0
    for data in options("data", compose_train.conf_dir):
        cfg = compose_train([f"model={name}", f"data={data}"])
        dm = build_data(cfg)
        if accepts(model_target, dm.model_kwargs()):
            build_model(cfg, dm)
            fitting += 1
    assert fitting, f"no data option provides the constructor arguments of model={name}"


def check_optim(name, compose_train, tmp_path):
    cfg = compose_train([f"optim={name}"])
    torch.manual_seed(0)
    build_optim(cfg, torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))


def check_callbacks(name, compose_train, tmp_path):
    cfg = compose_train([f"callbacks=[{name}]"])
    # DESIGN §3: conf/callbacks/NAME.yaml holds one top-level key NAME.
    assert list(cfg.callbacks) == [name]
    built = build_callbacks(cfg)
    build_trainer(cfg, tmp_path, built)


def check_experiment(name, compose_train, tmp_path):
    cfg = compose_train([f"+experiment={name}"])
    build_all(cfg, tmp_path)


def check_trainer(name, compose_train, tmp_path):
    cfg = compose_train([f"trainer={name}"])
    build_trainer(cfg, tmp_path)


def check_logger(name, compose_train, tmp_path):
    """The logger as run.py builds it (``save_dir: null`` = the run directory): it writes there."""
    from lightning.pytorch.loggers import Logger

    from parallelkit.run import build_logger

    cfg = compose_train([f"logger={name}"])
    logger = build_logger(cfg, tmp_path)
    assert isinstance(logger, Logger)
    logger.log_metrics({"train_loss": 1.5}, step=0)
    logger.save()
    logger.finalize("success")
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(tmp_path) for p in written), written


CHECKS = {
    "strategy": check_strategy,
    "data": check_data,
    "model": check_model,
    "optim": check_optim,
    "callbacks": check_callbacks,
    "experiment": check_experiment,
    "trainer": check_trainer,
    "logger": check_logger,
}


@pytest.mark.parametrize("path", option_files(), ids=lambda p: p.relative_to(CONF_DIR).as_posix())
def test_option_composes_and_instantiates(path, compose_train, tmp_path):
    group, name = group_and_name(path)
    if group not in CHECKS:
        pytest.fail(f"conf/{group}/ has no check in tests/unit/test_configs.py; add one to CHECKS")
    CHECKS[group](name, compose_train, tmp_path)


# --------------------------------------------------------------------------- coverage and the primary config


def test_every_conf_file_is_covered():
    files = sorted(CONF_DIR.rglob("*.yaml"))
    assert PRIMARY in files
    uncovered = [p for p in files if p != PRIMARY and group_and_name(p)[0] not in CHECKS]
    assert not uncovered, f"no check for {uncovered}"
    # Every group the primary config selects by default exists with its default option.
    defaults = OmegaConf.load(PRIMARY).defaults
    for entry in defaults:
        if isinstance(entry, str):
            continue
        ((group, choice),) = entry.items()
        assert group in CHECKS, group
        assert options(group), f"conf/{group}/ is empty"
        if choice is not None:
            assert (CONF_DIR / group / f"{choice}.yaml").is_file()


def test_primary_config_builds_everything(compose_train, tmp_path):
    cfg = compose_train([])
    build_all(cfg, tmp_path)
    assert cfg.hydra.run.dir == "outputs/default"


def test_strategy_timeouts_are_the_one_default():
    # YAML cannot import DEFAULT_TIMEOUT_S; the files repeat it so that strategy.timeout_s is a key to set.
    from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S

    timeouts = {p.name: OmegaConf.load(p).get("timeout_s") for p in (CONF_DIR / "strategy").glob("*.yaml")}
    timeouts = {name: t for name, t in timeouts.items() if t is not None}
    assert len(timeouts) >= 5, timeouts  # the files do set it (a rename of the key would pass silently otherwise)
    assert {name: t for name, t in timeouts.items() if t != DEFAULT_TIMEOUT_S} == {}


@pytest.mark.parametrize("group", ["strategy", "model", "data", "optim", "trainer"])
def test_unknown_option_is_a_hydra_error_listing_the_options(group, compose_train):
    with pytest.raises(ConfigCompositionException) as err:
        compose_train([f"{group}=nope"])
    message = str(err.value)
    assert "nope" in message
    for name in options(group):
        assert name in message


def test_unknown_experiment_and_callback_are_hydra_errors(compose_train):
    with pytest.raises(HydraException):
        compose_train(["+experiment=nope"])
    with pytest.raises(HydraException):
        compose_train(["callbacks=[nope]"])


def test_misspelt_key_is_refused_not_ignored(compose_train):
    with pytest.raises(ConfigCompositionException):
        compose_train(["strategy.bucket_cap_mbb=5"])


def test_command_line_values_reach_the_objects(compose_train):
    cfg = compose_train(["strategy=ddp", "strategy.bucket_cap_mb=5", "callbacks=[lr_monitor]", "callbacks.lr_monitor.logging_interval=epoch"])
    strategy, _ = build_strategy(cfg)
    assert strategy._ddp_options["bucket_cap_mb"] == 5
    (callback,) = build_callbacks(cfg)
    assert callback.logging_interval == "epoch"


# --------------------------------------------------------------------------- the run directory


def test_run_name_is_default_when_there_are_no_overrides():
    assert run_name("") == "default"


@pytest.mark.parametrize(
    "overrides",
    ["strategy=ddp,trainer.devices=2", "data.files=[a/b.txt,c\\d.txt]", "model.n_layer=2,seed=3", "x=a b\tc"],
)
def test_run_name_is_a_single_deterministic_path_component(overrides):
    name = run_name(overrides)
    assert name == run_name(overrides)
    assert name and not re.search(r"[/\\\s]", name)
    assert Path(name).name == name  # one component, no separators
    assert len(name) <= 255  # a file name
    # Only separators and whitespace are replaced; every other character is kept in place.
    expected_prefix = "".join("_" if ch in "/\\" or ch.isspace() else ch for ch in overrides)
    assert name.startswith(expected_prefix[:120])
    if expected_prefix != overrides:  # something was replaced: a hash keeps a/b and a_b apart
        assert name != expected_prefix and name != run_name(expected_prefix)


def test_run_name_keeps_long_and_colliding_overrides_apart():
    long_a = ",".join(f"model.layer_{i}=1" for i in range(40))
    long_b = long_a + ",seed=2"
    assert len(run_name(long_a)) < 200 and run_name(long_a) != run_name(long_b)
    assert run_name("data.files=[a/b]") != run_name("data.files=[a_b]")
    assert run_name("strategy=ddp") == "strategy=ddp"  # plain names stay readable


def test_run_dir_is_deterministic_and_ignores_ckpt_path(compose_train):
    a = compose_train(["trainer.devices=2", "strategy=ddp"]).hydra.run.dir
    b = compose_train(["strategy=ddp", "trainer.devices=2"]).hydra.run.dir
    c = compose_train(["strategy=ddp", "trainer.devices=2", "ckpt_path=last"]).hydra.run.dir
    d = compose_train(["strategy=single", "trainer.devices=2"]).hydra.run.dir
    assert a == b == c  # order of overrides and ckpt_path do not change the directory ...
    assert a != d  # ... a different run does
    override_dirname = HydraConfig.get().job.override_dirname
    assert d == f"outputs/{run_name(override_dirname)}"
    assert "now" not in OmegaConf.to_container(OmegaConf.load(PRIMARY).hydra.run)["dir"]


def test_negative_control_a_new_broken_file_is_discovered_and_fails(tmp_path):
    """A YAML dropped into a group is picked up by discovery, and a broken one fails its group's check."""
    from hydra.errors import InstantiationException

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "broken.yaml").write_text("_target_: parallelkit.models.mlp.MLP\nhidden: [0]\n")
    assert ("model", "broken") in [group_and_name(p, conf) for p in option_files(conf)]
    previous = HydraConfig.instance().cfg
    try:
        with pytest.raises(InstantiationException):
            CHECKS["model"]("broken", composer(conf), tmp_path)
        CHECKS["model"]("mlp", composer(conf), tmp_path)  # the untouched options still pass
    finally:
        HydraConfig.instance().cfg = previous
