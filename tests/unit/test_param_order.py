"""The single-device parameter order a one-file checkpoint numbers the optimizer state by (issue 33, item 3).

A rank of an interleaved pipeline saves stages 0 and 2 in one group list, an expert-parallel rank its own experts':
the lists' order is not the model's. ``TrainModule`` records the model's order in every checkpoint and
``convert``'s one-file writer numbers by it. The end-to-end check (directories of real runs converted and continued)
is tests/integration/test_checkpoint_convert.py; here, the writer's numbering on a hand-made checkpoint.
"""

from __future__ import annotations

import torch

from parallelkit.checkpoint.sources import PARAM_ORDER_KEY, Checkpoint, LazyTensor
from parallelkit.checkpoint.writers import write_file
from parallelkit.models.module import PARAM_ORDER_KEY as RECORDED_KEY
from parallelkit.models.module import TrainModule

ORDER = ["model.emb", "model.blocks.0.w", "model.blocks.1.w", "model.blocks.2.w", "model.head"]


def lazy(value: float) -> LazyTensor:
    return LazyTensor((2,), torch.float32, lambda: torch.full((2,), float(value)))


def grouped_checkpoint(path, meta: dict) -> Checkpoint:
    # An interleaved pipeline's merged groups: rank 0's stages (0 and 2) first, then rank 1's (1 and 3).
    listed = ["model.emb", "model.blocks.1.w", "model.blocks.0.w", "model.blocks.2.w", "model.head"]
    model = {name: lazy(i) for i, name in enumerate(ORDER)}
    state = {name: {"exp_avg": lazy(10 + i), "step": torch.tensor(3.0)} for i, name in enumerate(ORDER)}
    optimizer = {"state": state, "param_groups": [{"lr": 0.1, "params": listed}], "keyed_groups": [], "order_known": True}
    return Checkpoint(path, "dcp", model, [optimizer], meta)


def test_the_module_records_its_single_device_order_under_the_key_the_reader_uses():
    assert RECORDED_KEY == PARAM_ORDER_KEY
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    module = TrainModule(model, lambda params: torch.optim.SGD(params, lr=0.1))
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint[PARAM_ORDER_KEY] == ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]


def test_one_file_numbers_the_optimizer_state_in_the_recorded_order(tmp_path):
    write_file(grouped_checkpoint(tmp_path, {PARAM_ORDER_KEY: ORDER}), tmp_path / "one.ckpt")
    saved = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert list(saved["state_dict"]) == ORDER
    optimizer = saved["optimizer_states"][0]
    assert optimizer["param_groups"][0]["params"] == [0, 1, 2, 3, 4]
    # index i holds the moments of the i-th parameter of the model (10 + i by construction)
    assert all(torch.equal(optimizer["state"][i]["exp_avg"], torch.full((2,), 10.0 + i)) for i in range(5))


def test_negative_control_without_the_order_the_group_lists_order_misnumbers(tmp_path):
    write_file(grouped_checkpoint(tmp_path, {}), tmp_path / "one.ckpt")
    optimizer = torch.load(tmp_path / "one.ckpt", weights_only=False)["optimizer_states"][0]
    moments = [float(optimizer["state"][i]["exp_avg"][0]) for i in range(5)]
    assert moments != [10.0 + i for i in range(5)]
