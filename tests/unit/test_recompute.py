"""Activation recomputation on the GPT: same gradients, fewer saved activations, the expected extra forwards.

Counted, not assumed: forward hooks count how often each module runs per training step, and autograd's
saved-tensor hooks measure the bytes kept for backward.
"""

from __future__ import annotations

import pytest
import torch

from torch.utils.checkpoint import set_checkpoint_early_stop

from parallelkit.distributed.recompute import apply_recompute
from parallelkit.errors import ConfigError
from parallelkit.models.gpt.model import GPT


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _step(model: GPT) -> dict:
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(idx), torch.roll(idx, -1, 1))
    loss.backward()
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "calls": calls, "saved": sum(saved)}


def test_recompute_keeps_gradients_and_recomputes_what_it_says():
    base = _step(_gpt())
    runs = {}
    for mode in ("full", "selective"):
        model = _gpt()
        wrapped = apply_recompute(model, mode)
        # Count the whole recomputation: by default checkpointing stops early, once the tensors backward
        # needs are back (a unit's last projection then does not rerun); that case is checked below.
        with set_checkpoint_early_stop(False):
            runs[mode] = _step(model)
        for name, grad in base["grads"].items():
            torch.testing.assert_close(runs[mode]["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=f"{mode} {name}")
        assert len(wrapped) == (2 if mode == "full" else 4)  # 2 blocks, or attn + mlp of each

    assert all(v == 1 for v in base["calls"].values())  # the control: once per step without recompute
    full, selective = runs["full"]["calls"], runs["selective"]["calls"]
    for name in base["calls"]:
        inside_block = name.startswith("layers.") and name.count(".") >= 2  # a block's submodules
        assert full[name] == (2 if inside_block else 1), name
        # The units themselves (layers.i.attn / .mlp) are called once; what runs inside them, twice.
        in_attn_or_mlp = name.count(".") >= 3 and name.split(".")[2] in ("attn", "mlp")
        assert selective[name] == (2 if in_attn_or_mlp else 1), name
    # Saved activations: full keeps only block inputs; selective also keeps the norms' activations.
    assert runs["full"]["saved"] < runs["selective"]["saved"] < base["saved"]


def test_default_early_stop_still_recomputes_each_unit():
    model = _gpt()
    apply_recompute(model, "selective")
    calls = _step(model)["calls"]
    for layer in ("0", "1"):
        assert calls[f"layers.{layer}.attn.q_proj"] == 2 and calls[f"layers.{layer}.mlp.up_proj"] == 2
        assert calls[f"layers.{layer}.ln_1"] == 1


def test_unknown_mode_is_an_error():
    with pytest.raises(ConfigError, match="recompute must be one of none, full, selective"):
        apply_recompute(_gpt(), "some")
