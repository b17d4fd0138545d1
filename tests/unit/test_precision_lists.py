"""Custom white/black lists: a black-listed module computes in fp32 under autocast, a white-listed one in half.

Autocast alone runs ``Linear`` in half precision and leaves ``LayerNorm`` of an fp32 input in fp32 on CPU;
the lists must flip both, which is observed inside the modules (the dtypes their forward sees and returns) and in the
gradients, which still reach the fp32 parameters.
"""

from __future__ import annotations

import pytest
import torch

from parallelkit.distributed.precision_lists import apply_precision_lists
from parallelkit.errors import ConfigError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.norm(x)))


def _dtypes(net: Net, half: torch.dtype) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    for name in ("proj", "norm", "head"):
        getattr(net, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=half):
        out = net(x)
    out.float().sum().backward()
    return seen


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_lists_flip_autocast_decisions(half):
    torch.manual_seed(0)
    plain = _dtypes(Net(), half)
    assert plain == {"norm": torch.float32, "proj": half, "head": half}  # autocast's own lists (the control)

    net = Net()
    matched = apply_precision_lists(net, "cpu", half, white=["LayerNorm"], black=["proj"])
    assert matched == {"white": ["norm"], "black": ["proj"]}
    assert _dtypes(net, half) == {"norm": half, "proj": torch.float32, "head": half}
    for p in net.parameters():  # gradients reach the fp32 master weights through the casts
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_black_listed_module_matches_fp32_exactly():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    reference = net.proj(x)  # no autocast at all
    apply_precision_lists(net, "cpu", torch.float16, black=["torch.nn.modules.linear.Linear"])
    with torch.autocast("cpu", dtype=torch.float16):
        out = net.proj(x)  # autocast alone would run this matmul in fp16
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_unknown_or_conflicting_entries_are_errors():
    with pytest.raises(ConfigError, match="'mlp.nope' matches no module"):
        apply_precision_lists(Net(), "cpu", torch.float16, black=["mlp.nope"])
    with pytest.raises(ConfigError, match="both custom_white_list and custom_black_list"):
        apply_precision_lists(Net(), "cpu", torch.float16, white=["norm"], black=["norm"])
