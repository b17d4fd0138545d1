"""Expert parallelism: spread the experts of Mixture-of-Experts layers over ranks; tokens travel by all-to-all.

Each of the ``ep`` ranks of an expert-parallel group keeps ``E / ep`` experts (contiguous blocks of global
expert ids) and deletes the others. In every MoE layer, forward:

1. *routing*: the layer's routing statistics (assignments per expert, router probabilities) are gathered
   over the data-parallel ranks, so capacity and the load-balancing loss are decided over the global
   micro-batch exactly as one process with the whole batch decides them (see ``models/moe_gpt/model.py``);
2. *dispatch*: the kept tokens, sorted by expert, go to the rank that owns their expert
   (``all_to_all_single`` with split sizes: only routed tokens travel, no padding), after a tiny
   all-to-all of the per-expert counts so every rank knows what it receives;
3. the local experts run on what arrived (regrouped expert by expert);
4. *combine*: the outputs travel back (the reverse all-to-all) and the layer weights and sums them.

The token all-to-alls are autograd functions whose backward is the reverse all-to-all, so a layer costs
two token all-to-alls in forward and two in backward, each counted as ``moe_all_to_all`` (bytes sent to
other ranks; a rank's own chunk stays home). The count exchange and the routing gather are counted as
``moe_routing``.

Gradients: an expert on one rank processes the tokens of all ``ep`` ranks of its group, so its gradient
holds contributions of ``ep`` local losses; data parallelism then averages over the ``dp / ep`` ranks
holding the same expert. Dividing the expert gradients by ``ep`` (a hook registered here) makes the result
the mean over all data-parallel ranks, like every dense parameter's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallelkit.distributed.collectives import all_gather_single
from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.errors import ConfigError

MOE_ALL_TO_ALL = "moe_all_to_all"
MOE_ROUTING = "moe_routing"


@dataclass
class MoESite:
    """One MoE layer as a model's plan describes it.

    Args:
        name: the layer's module name (for messages).
        experts: the module called as ``experts(tokens sorted by expert, counts per held expert)``.
        experts_dict: the ``ModuleDict`` of expert modules inside it, keyed by global expert id.
        routing_owner: the module whose ``routing`` attribute gathers routing statistics
            (``routing.gather(stats) -> (stats of all ranks, this rank's index)``).
    """

    name: str
    experts: nn.Module
    experts_dict: nn.ModuleDict
    routing_owner: nn.Module


@dataclass
class ExpertParallelPlan:
    """What a model's ``parallelize.py`` tells :func:`apply_ep`: the expert count and the MoE layers."""

    num_experts: int
    sites: list[MoESite] = field(default_factory=list)


@dataclass
class ExpertParallelHandle:
    """What :func:`apply_ep` returns: the parameters the strategy must average over which group."""

    expert_params: list[nn.Parameter]
    dense_params: list[nn.Parameter]
    local_experts: list[int]


def check_expert_parallel(plan: ExpertParallelPlan, ep: int) -> None:
    """Raise :class:`ConfigError` if ``ep`` ranks cannot share the plan's experts evenly."""
    if not plan.sites:
        raise ConfigError(
            "strategy=moe found no MoE layer in the model. Use model=moe_gpt (or a model whose parallelize.py has an expert_parallel_plan with MoE layers)."
        )
    if plan.num_experts % ep:
        fits = [d for d in range(1, plan.num_experts + 1) if plan.num_experts % d == 0]
        raise ConfigError(
            f"model.num_experts={plan.num_experts} is not divisible by strategy.ep={ep}: every expert-parallel rank "
            f"must hold the same number of experts. Use strategy.ep in {fits} or a multiple of {ep} experts."
        )


def local_expert_ids(num_experts: int, ep: int, ep_rank: int) -> list[int]:
    """The global ids of the experts that expert-parallel rank ``ep_rank`` holds: one contiguous block."""
    per_rank = num_experts // ep
    return list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))


class CollectiveRouting:
    """Gathers every data-parallel rank's routing statistics (the seam ``MoELayer.routing``)."""

    def __init__(self, group: Any, comm_stats: CommStats | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm_stats = comm_stats

    @torch.no_grad()
    def gather(self, stats: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.size == 1:
            return stats.unsqueeze(0), 0
        out = stats.new_empty(self.size * stats.numel())  # gloo wants a flat output
        with counting(self.comm_stats, MOE_ROUTING):
            all_gather_single(out, stats.reshape(-1).contiguous(), group=self.group)
        return out.view(self.size, *stats.shape), self.rank


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes whose backward is the reverse exchange; both are counted."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, stats: CommStats | None, me: int) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.stats, ctx.me = (out_splits, in_splits), group, stats, me
        return _exchange(x, out_splits, in_splits, group, stats, me)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.stats, ctx.me), None, None, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, stats: CommStats | None, me: int) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with counting(stats, MOE_ALL_TO_ALL):  # every rank but this one gets its rows (gloo: even an empty split is a message)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _TokenDispatch:
    """Forward hooks around a grouped-experts module: dispatch before it runs, combine after."""

    def __init__(self, num_experts: int, group: Any, comm_stats: CommStats | None) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.per_rank = num_experts // self.ep
        self.comm_stats = comm_stats
        self._pending: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def dispatch(self, module: nn.Module, args: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, counts = args  # counts: per global expert, tokens sorted by global expert
        ep, per_rank = self.ep, self.per_rank
        send_counts = counts.view(ep, per_rank).contiguous()
        recv_counts = torch.empty_like(send_counts)
        with counting(self.comm_stats, MOE_ROUTING):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # recv[src, local expert]
        in_splits = send_counts.sum(dim=1).tolist()
        out_splits = recv_counts.sum(dim=1).tolist()
        received = _AllToAll.apply(tokens, out_splits, in_splits, self.group, self.comm_stats, self.me)
        # Arrived source by source (each sorted by expert); the experts want them expert by expert.
        starts = (recv_counts.reshape(-1).cumsum(0) - recv_counts.reshape(-1)).view(ep, per_rank)
        sizes = recv_counts.t().reshape(-1)  # blocks in (local expert, source) order
        block_start = starts.t().reshape(-1)
        order = torch.repeat_interleave(block_start - (sizes.cumsum(0) - sizes), sizes) + torch.arange(int(sizes.sum()), device=sizes.device)
        self._pending.append((order.to(tokens.device), in_splits, out_splits))
        return received[order], recv_counts.sum(dim=0)

    def combine(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        order, in_splits, out_splits = self._pending.pop()
        by_source = torch.empty_like(output).index_copy(0, order, output)  # undo the regrouping
        return _AllToAll.apply(by_source, in_splits, out_splits, self.group, self.comm_stats, self.me)


def apply_ep(
    model: nn.Module,
    plan: ExpertParallelPlan,
    *,
    ep_group: Any,
    routing_group: Any,
    comm_stats: CommStats | None = None,
) -> ExpertParallelHandle:
    """Shard the experts of ``plan`` over ``ep_group`` and route tokens to them with all-to-alls, in place.

    Args:
        model: the single-device model (its parameters identical on every rank).
        plan: from the model's ``parallelize.py`` (e.g. ``moe_gpt.parallelize.expert_parallel_plan``).
        ep_group: the expert-parallel group (consecutive data-parallel ranks); its size ``ep`` divides
            the expert count; rank ``r`` of it keeps experts ``r·E/ep … (r+1)·E/ep - 1``.
        routing_group: all data-parallel ranks (those that see different tokens): capacity and the
            load-balancing statistics are global over them.
        comm_stats: where the all-to-alls and the routing gather are counted.

    Returns:
        the expert and the dense parameters (average the first over ranks holding the same experts,
        the second over all data-parallel ranks) and this rank's expert ids.

    Example::

        handle = apply_ep(model, expert_parallel_plan(model), ep_group=ep, routing_group=dp, comm_stats=s)
        apply_grad_allreduce(handle.dense_params, dp)
        apply_grad_allreduce(handle.expert_params, expert_dp)
    """
    ep = dist.get_world_size(ep_group)
    check_expert_parallel(plan, ep)
    mine = local_expert_ids(plan.num_experts, ep, dist.get_rank(ep_group))
    expert_params: list[nn.Parameter] = []
    for site in plan.sites:
        if sorted(map(int, site.experts_dict.keys())) != list(range(plan.num_experts)):
            raise ValueError(f"{site.name}: apply_ep expects all {plan.num_experts} experts keyed 0..{plan.num_experts - 1}, got {list(site.experts_dict)}")
        for key in list(site.experts_dict.keys()):
            if int(key) not in mine:
                del site.experts_dict[key]
        site.routing_owner.routing = CollectiveRouting(routing_group, comm_stats)
        if ep > 1:
            hooks = _TokenDispatch(plan.num_experts, ep_group, comm_stats)
            site.experts.register_forward_pre_hook(hooks.dispatch)
            site.experts.register_forward_hook(hooks.combine)
        expert_params.extend(p for p in site.experts_dict.parameters() if p.requires_grad)
    if ep > 1:
        for param in expert_params:
            param.register_hook(lambda grad: grad / ep)
    expert_ids = {id(p) for p in expert_params}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
    return ExpertParallelHandle(expert_params=expert_params, dense_params=dense, local_experts=mine)
