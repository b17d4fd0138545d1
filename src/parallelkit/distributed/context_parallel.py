"""Context parallelism applied to a model: each of ``cp`` ranks holds a part of every sequence.

Every layer but attention works token by token, so a model runs on a sequence shard unchanged except for three
things, which :func:`apply_cp` provides from the model's :class:`ContextParallelPlan` (model code stays
single-device; the plan names modules, as tensor parallelism's does):

1. **The batch**: every tensor with a sequence dimension (token ids, targets, masks: dim 1) is cut to this rank's
   two chunks of the load-balanced layout (:func:`~parallelkit.distributed.context_parallel_attention.load_balanced_shard`),
   right after the batch reaches the device (:meth:`ContextParallel.cut_batch`, the strategy's ``batch_to_device``).
   The ``cp`` ranks read the same batch (their data-parallel rank is the same), so the cut is as deterministic and
   resumable as the loader; the sequence length must divide by ``2·cp``.
2. **Positions**: the modules that turn position ids into embeddings (GPT's learned ``pos_emb``, a rotary
   embedding) receive the ids of this rank's tokens in the *whole* sequence, not ``0 … seq/cp − 1``.
3. **Attention**: inside the plan's attention modules, ``F.scaled_dot_product_attention`` is replaced (a
   ``TorchFunctionMode`` around their forward, as torchtitan's context parallel does) by ring attention or
   all-to-all (Ulysses) attention over the ``cp`` group. Its causal mask (``is_causal``, or the causal mask a
   Hugging Face model builds for the local length) becomes the mask of the whole sequence. An attention module
   that computes attention some other way (``attn_implementation=eager``) is an error at its first call, never a
   silently local attention.

The loss each rank computes is the mean over its tokens; with equal token counts per rank, averaging gradients over
``cp`` (the data-parallel gradient average spans ``dp × sharding × cp``) gives the gradient of the mean over the
whole sequence, as one process computes it.

**Which mode.** Ring attention (default) sends each rank's keys and values around the ring, overlapped with block
compute: ``(3·cp − 2) × 2·|k|`` bytes per rank and layer (forward + backward), any ``cp``, GQA key/value heads travel
un-repeated. All-to-all sends q, k, v and the output once each way (8 all-to-alls of ``(cp − 1)/cp`` of a tensor per
layer), fewer and larger messages, but ``cp`` must divide the heads (key/value heads too, or be divided by them):
prefer it on fast links with many heads, ring attention for large ``cp`` or few key/value heads.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from parallelkit.distributed.context_parallel_attention import (  # noqa: F401 - re-exported: the technique's API
    CP_ALL_TO_ALL,
    CP_RING_P2P,
    RingCounts,
    check_gqa,
    check_ulysses_heads,
    load_balanced_positions,
    load_balanced_shard,
    load_balanced_unshard,
    ring_attention,
    ring_payload_bytes,
    ulysses_attention,
)
from parallelkit.errors import ConfigError

#: ``strategy.cp_mode`` values.
CP_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class ContextParallelPlan:
    """How context parallelism meets one model (a model's ``context_parallel_plan(model)`` returns it).

    Args:
        attention: module names (``fnmatch`` patterns, ``layers.*.attn``) whose forward computes attention with
            ``F.scaled_dot_product_attention``.
        positions: modules that take position ids (as their first argument or ``position_ids=``): a learned
            position embedding, a rotary embedding.
        heads / kv_heads: attention heads and key/value heads (all-to-all attention splits them over ``cp``).
    """

    attention: tuple[str, ...]
    positions: tuple[str, ...] = ()
    heads: int = 1
    kv_heads: int = 1


def check_context_parallel(plan: ContextParallelPlan, cp: int, mode: str, *, tp: int = 1, seq_len: int | None = None) -> None:
    """Before launch: ``mode`` exists, all-to-all can split the heads (those left after tensor parallelism), the
    sequence divides into ``2·cp`` chunks."""
    if mode not in CP_MODES:
        raise ConfigError(f"strategy.cp_mode must be one of {', '.join(CP_MODES)}. Got {mode!r}.")
    if mode == "ulysses":
        check_ulysses_heads(plan.heads // tp, max(plan.kv_heads // tp, 1), cp)
    if seq_len is not None:
        load_balanced_positions(seq_len, cp, 0)  # raises with the data.seq_len message


class ContextParallel:
    """What :func:`apply_cp` made: the batch cut, the position map and the attention of one rank of a ``cp`` group."""

    def __init__(self, group: Any, cp: int, rank: int, mode: str, comm_stats: Any = None) -> None:
        self.group, self.cp, self.rank, self.mode, self.comm_stats = group, cp, rank, mode, comm_stats
        self.counts = RingCounts()  # blocks computed / skipped by ring attention on this rank
        self.attention_calls = 0
        self._positions: dict[tuple[int, str], torch.Tensor] = {}

    def cut_batch(self, batch: Any) -> Any:
        """This rank's part of every tensor with a sequence dimension (dim 1) in ``batch`` (any nesting)."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def cut(t: torch.Tensor) -> torch.Tensor:
            return load_balanced_shard(t, self.cp, self.rank, dim=1) if t.dim() >= 2 else t

        return apply_to_collection(batch, torch.Tensor, cut)

    def global_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Local position ids ``0 … n − 1`` → the positions of this rank's tokens in the whole sequence of ``n·cp``."""
        from torch.distributed.tensor import DTensor

        if isinstance(ids, DTensor):  # tensor parallelism hands a module with replicated parameters replicated inputs
            return DTensor.from_local(self.global_positions(ids.to_local()), ids.device_mesh, ids.placements, run_check=False)
        n = ids.shape[-1]
        key = (n, str(ids.device))
        if key not in self._positions:
            self._positions[key] = load_balanced_positions(n * self.cp, self.cp, self.rank).to(ids.device)
        table = self._positions[key]
        if not torch.equal(ids, torch.arange(n, device=ids.device).expand_as(ids)):
            raise ConfigError("context parallelism maps position ids 0 … n−1 of a sequence shard to the whole sequence's; "
                              "this model passed other ids (packed sequences or a cache), which it cannot place.")
        return table[ids]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """``F.scaled_dot_product_attention``'s signature, over the whole sequence of the ``cp`` group."""
        self.attention_calls += 1
        if dropout_p:
            raise ConfigError(f"attention dropout ({dropout_p}) under context parallelism: no rank holds a whole row of "
                              "attention scores to drop from. Set the model's attention dropout to 0.")
        if attn_mask is not None:
            _check_local_causal(attn_mask, q.shape[2], k.shape[2])
            is_causal = True
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.group, causal=is_causal, scale=scale, stats=self.comm_stats)
        return ring_attention(q, k, v, self.group, causal=is_causal, scale=scale, stats=self.comm_stats, counts=self.counts)

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the degree, the mode and, for ring attention, the blocks each rank of the cp group
        computed and skipped (the load balance). Collective over the group: every rank calls it."""
        import torch.distributed as dist

        from parallelkit.distributed.comm_counting import counting
        from parallelkit.distributed.comm_stats import REPORT

        out: dict[str, Any] = {"cp": self.cp, "mode": self.mode}
        if self.mode == "ring":
            mine = torch.tensor([self.counts.forward_blocks, self.counts.backward_blocks, self.counts.skipped_blocks])
            rows = [torch.zeros_like(mine) for _ in range(self.cp)]
            report = self.comm_stats.counting_as(REPORT) if self.comm_stats is not None else contextlib.nullcontext()
            with report, counting(self.comm_stats, "metrics"):  # as the strategy's own report: not a training step's traffic
                dist.all_gather(rows, mine, group=self.group)
            out.update(blocks_computed_forward=[int(r[0]) for r in rows], blocks_computed_backward=[int(r[1]) for r in rows],
                       blocks_skipped=[int(r[2]) for r in rows])
        return out


def _check_local_causal(mask: torch.Tensor, q_len: int, k_len: int) -> None:
    """The mask a model built for its local sequence must be the plain causal one (it is then the whole sequence's)."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    if allowed.shape[-2:] != causal.shape or not bool((allowed == causal).all()):
        raise ConfigError("context parallelism supports causal (or full) attention; this model passed another attention "
                          "mask (padding, sliding window, packed documents), which the sequence shards cannot rebuild.")


class _AttentionOverride(TorchFunctionMode):
    """Replaces ``F.scaled_dot_product_attention`` with context-parallel attention while it is active."""

    def __init__(self, handle: ContextParallel) -> None:
        super().__init__()
        self.handle = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.handle.attention(*args, **kwargs)
        return func(*args, **kwargs)


def _wrap_attention(module: torch.nn.Module, name: str, handle: ContextParallel) -> None:
    forward = module.forward

    def forward_over_cp(*args: Any, **kwargs: Any) -> Any:
        before = handle.attention_calls
        with _AttentionOverride(handle):
            out = forward(*args, **kwargs)
        if handle.attention_calls == before:
            raise ConfigError(f"{name} ({type(module).__name__}) is named by the context-parallel plan but computed attention "
                              "without F.scaled_dot_product_attention, which context parallelism replaces (for Hugging Face "
                              "models: model.attn_implementation=sdpa).")
        return out

    module.forward = forward_over_cp  # an instance attribute: the class (and every other instance) is untouched


def _position_hook(handle: ContextParallel):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = handle.global_positions(kwargs["position_ids"])
        elif args:
            args = (handle.global_positions(args[0]),) + tuple(args[1:])
        return args, kwargs

    return hook


def apply_cp(model: torch.nn.Module, cp_mesh: Any, plan: ContextParallelPlan, *, mode: str = "ring",
             comm_stats: Any = None) -> ContextParallel:
    """Give ``model``'s attention and position modules the whole sequence of the ``cp`` group (see the module docstring).

    Args:
        model: the single-device model (tensor-parallel already, if ``tp > 1``).
        cp_mesh: the 1-D ``cp`` mesh (``mesh["cp"]``).
        plan: the model's :class:`ContextParallelPlan`.
        mode: ``ring`` or ``ulysses``.
        comm_stats: counts the ring's and the all-to-alls' bytes.

    Returns:
        The :class:`ContextParallel` handle; the strategy cuts each batch with its :meth:`~ContextParallel.cut_batch`.
    """
    cp = cp_mesh.size()
    check_context_parallel(plan, cp, mode)
    handle = ContextParallel(cp_mesh.get_group(), cp, cp_mesh.get_local_rank(), mode, comm_stats)
    named = dict(model.named_modules())
    for kind, patterns in (("attention", plan.attention), ("positions", plan.positions)):
        for pattern in patterns:
            found = [name for name in named if fnmatch.fnmatchcase(name, pattern)]
            if not found:
                raise ConfigError(f"the context-parallel plan's {kind} pattern {pattern!r} matches no module of {type(model).__name__}.")
            for name in found:
                if kind == "attention":
                    _wrap_attention(named[name], name, handle)
                else:
                    named[name].register_forward_pre_hook(_position_hook(handle), with_kwargs=True)
    return handle
