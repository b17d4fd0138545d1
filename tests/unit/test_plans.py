"""Where plans come from (``parallelkit.models.plans``), which modules are units (``distributed.blocks``), the
strategy protocol's defaults (``strategy_protocol``) and the model contract (``models.contract``): no
process group needed."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from parallelkit.distributed.blocks import blocks_or_children, modules_by_class, modules_by_size, repeated_blocks, select_units
from parallelkit.errors import ConfigError
from parallelkit.models.contract import as_lightning_module, check_model_fits_data, import_target
from parallelkit.models.plans import ModelPlans, model_plans, parallel_model


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(4, 10)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A user package ``userpkg`` with a model class and, beside it, a parallelize module with one plan."""
    root = tmp_path / "userpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "net.py").write_text("import torch\nclass Net(torch.nn.Module):\n    pass\n")
    (root / "parallelize.py").write_text("def pipeline_blocks(model):\n    return 'beside'\n"
                                         "def pipeline_stages(model, blocks, ids):\n    return ['beside']\n")
    (root / "elsewhere.py").write_text("def pipeline_blocks(model):\n    return 'named'\n"
                                       "class Plans:\n    def pipeline_blocks(self, model):\n        return 'object'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [n for n in sys.modules if n == "userpkg" or n.startswith("userpkg.")]:
        del sys.modules[name]


def test_plans_beside_the_class_then_the_models_methods_then_the_config(package):
    from userpkg.net import Net as UserNet

    model = UserNet()
    assert ModelPlans(model).find("pipeline_blocks")(model) == "beside"
    model.pipeline_blocks = lambda: "method"  # the model's own method wins over the module beside its class
    assert ModelPlans(model).find("pipeline_blocks")(model) == "method"
    assert ModelPlans(model, "userpkg.elsewhere").find("pipeline_blocks")(model) == "named"  # the config wins
    assert ModelPlans(model, "userpkg.elsewhere.Plans").find("pipeline_blocks")(model) == "object"  # a class: instantiated
    # A source without a function is skipped for that function only.
    assert ModelPlans(model, "userpkg.elsewhere").find("pipeline_stages")(model, [], []) == ["beside"]
    assert ModelPlans(model).find("tensor_parallel_plan") is None


def test_builtin_models_use_the_same_mechanism():
    from parallelkit.models.gpt import GPT

    gpt = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    plans = ModelPlans(gpt)
    assert plans.has("tensor_parallel_plan", "pipeline_blocks", "pipeline_stages")
    assert plans.pipeline_blocks() == 2
    assert not plans.has("expert_parallel_plan")


def test_missing_plan_names_the_function_its_signature_and_where_it_may_go(package):
    from userpkg.net import Net as UserNet

    with pytest.raises(ConfigError) as err:
        ModelPlans(UserNet()).tensor_parallel_plan(2, who="strategy=tp")
    message = str(err.value)
    for words in ("strategy=tp needs a tensor parallel plan for Net", "tensor_parallel_plan(model, tp, *, sequence_parallel)",
                  "strategy.plan=PATH", "a method tensor_parallel_plan(...) of Net", "userpkg.parallelize", "model=gpt"):
        assert words in message, words
    # pipeline_blocks is beside the class, but a cut needs pipeline_stages too: asked together, refused together.
    (package / "parallelize.py").write_text("def pipeline_blocks(model):\n    return 2\n")
    del sys.modules["userpkg.parallelize"]
    with pytest.raises(ConfigError, match="pipeline_stages"):
        ModelPlans(UserNet()).pipeline_blocks()
    # No loss from the plan and none on the model: said too.
    with pytest.raises(ConfigError, match="loss"):
        ModelPlans(UserNet()).pipeline_loss()


def test_a_plan_source_that_does_not_import_is_one_clear_error(package):
    with pytest.raises(ConfigError, match="strategy.plan=nosuchpkg.plans does not import"):
        ModelPlans(Net(), "nosuchpkg.plans")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        ModelPlans(Net(), "userpkg.elsewhere.Nope")
    (package / "broken.py").write_text("import nosuchdependency\n")
    with pytest.raises(ConfigError, match="nosuchdependency"):
        ModelPlans(Net(), "userpkg.broken")


def test_a_lightning_module_names_what_is_parallelized():
    import lightning.pytorch as pl

    class Wrapper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        @property
        def parallel_model(self) -> torch.nn.Module:
            return self.net

    class Whole(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

    wrapper, whole = Wrapper(), Whole()
    assert parallel_model(wrapper) is wrapper.net and model_plans(wrapper).model is wrapper.net
    assert parallel_model(whole) is whole


# ------------------------------------------------------------------------------------ units
def test_unit_policies():
    net = Net()
    assert repeated_blocks(net) == list(net.blocks) == select_units(net)
    assert modules_by_class(net, ["Block"]) == list(reversed(net.blocks))
    # Children first (post-order) where units nest: the Linears inside a Block come before it.
    nested = modules_by_class(net, ["Block", "torch.nn.modules.linear.Linear"])
    order = {id(m): i for i, m in enumerate(nested)}
    for block in net.blocks:
        assert order[id(block.up)] < order[id(block)] and order[id(block.down)] < order[id(block)]
    assert net.emb not in nested and net.head in nested
    with pytest.raises(ConfigError, match=r"names \['Blok'\].*Block, Embedding, Linear, ModuleList, Net"):
        modules_by_class(net, ["Blok"])
    with pytest.raises(ConfigError, match="ModuleList has no forward"):
        modules_by_class(net, ["ModuleList"])
    # By size, bottom-up: an Embedding(10, 4) and each Linear(4, 8) hold 40 parameters, a Linear(8, 4) 36, the
    # head 50; a Block what its children left (76 at 41). Containers without forward are never units.
    assert modules_by_size(net, 40) == [net.emb, *(b.up for b in net.blocks), net.head]
    assert modules_by_size(net, 41) == [*net.blocks, net.head]
    assert select_units(net, min_params=41) == [*net.blocks, net.head]


def test_blocks_or_children_falls_back_to_the_top_level_children():
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    assert blocks_or_children(seq) == [seq[0], seq[2]]  # ReLU holds no parameters


# ------------------------------------------------------------------------------------ contract and protocol
def test_import_target_says_why():
    assert import_target("torch.nn.Linear", "model._target_") is torch.nn.Linear
    with pytest.raises(ConfigError, match="model._target_=nosuchpkg.Net does not import: there is no module named 'nosuchpkg'"):
        import_target("nosuchpkg.Net", "model._target_")
    with pytest.raises(ConfigError, match="module torch.nn has no 'Nope'"):
        import_target("torch.nn.Nope", "model._target_")


def test_model_contract():
    with pytest.raises(ConfigError, match="does not fit data=chars.*takes no \\['block_size', 'vocab_size'\\]"):
        check_model_fits_data(Net, {"vocab_size": 3, "block_size": 4}, "model._target_=x.Net", "data=chars")
    with pytest.raises(ConfigError, match="without a loss\\(outputs, targets\\) method"):
        as_lightning_module(Net(), "model=mine", lambda m: m, [])
    with pytest.raises(ConfigError, match="not an nn.Module"):
        as_lightning_module(types.SimpleNamespace(), "model=mine", lambda m: m, [])
    import lightning.pytorch as pl

    lit = pl.LightningModule()
    assert as_lightning_module(lit, "model=mine", lambda m: None, []) is lit
    with pytest.raises(ConfigError, match="optim=sgd cannot take effect"):
        as_lightning_module(lit, "model=mine", lambda m: None, ["optim=sgd"])


def test_a_strategy_that_is_not_parallelkits_takes_part_with_steps_that_do_nothing():
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP

    from parallelkit.strategies import DDPStrategy
    from parallelkit.strategy_protocol import ForeignStrategy, as_protocol

    ours = DDPStrategy()
    assert as_protocol(ours) is ours and ours.lightning_strategy is ours
    stock = LightningDDP()
    foreign = as_protocol(stock)
    assert isinstance(foreign, ForeignStrategy) and foreign.lightning_strategy is stock
    assert foreign.resolve(None, 2, 1) is foreign and foreign.plan(2).dp == 2
    foreign.check_model(Net(), 2)  # no-ops
    foreign.check_workload(Net(), None)
    with pytest.raises(ConfigError, match="not a Lightning strategy"):
        as_protocol(object())
