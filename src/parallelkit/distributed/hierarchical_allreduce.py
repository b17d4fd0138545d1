"""Hierarchical all-reduce as a DDP comm hook: reduce inside each node, all-reduce among node leaders,
broadcast inside each node.

On a cluster, ranks inside a node talk over NVLink/shared memory and only the leaders use the slower
network, so the inter-node traffic is one bucket per node instead of one per rank (Horovod's and
PaddlePaddle's ``use_hierarchical_allreduce``). Groups are ``local_size`` consecutive ranks of the
data-parallel group (the order launchers number ranks in a node); on one machine they simulate nodes.

Counting (``CommStats``): ``hierarchical_intra`` is what a rank sends inside its group, at the algorithms
the backend runs (:func:`~parallelkit.distributed.comm_stats.wire_bytes`). On gloo the reduce is itself a
ring reduce-scatter plus a gather to the leader, so the leader sends (k−1)/k of the bucket too and a
non-leader the whole bucket; the broadcast is a binomial tree, so the leader sends ⌈log₂ k⌉ copies and inner
ranks relay (k = ``local_size``). ``hierarchical_inter`` is what a leader sends in the all-reduce among
leaders (non-leaders send nothing across groups).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_hooks import counts_own_traffic
from parallelkit.distributed.comm_stats import CommStats

INTRA = "hierarchical_intra"
INTER = "hierarchical_inter"


class HierarchicalState:
    """This rank's groups: its node group and leader, and (on leaders) the group of all leaders."""

    def __init__(self, local_group: Any, leader: int, leader_group: Optional[Any], world_size: int,
                 num_groups: int, stats: Optional[CommStats] = None) -> None:
        self.local_group = local_group
        self.leader = leader  # global rank of this group's leader
        self.leader_group = leader_group  # None on non-leaders
        self.world_size = world_size
        self.num_groups = num_groups
        self.stats = stats


def build_hierarchical_state(local_size: int, group: Any = None, stats: Optional[CommStats] = None) -> HierarchicalState:
    """Create the node and leader groups for ``local_size`` ranks per node (a collective: every rank calls it).

    Raises ``ValueError`` if ``local_size`` does not divide the group size.
    """
    group = group if group is not None else dist.group.WORLD
    ranks: List[int] = dist.get_process_group_ranks(group)
    world = len(ranks)
    if local_size < 1 or world % local_size:
        raise ValueError(f"local_size={local_size} does not divide the {world} data-parallel ranks")
    me = dist.get_rank()
    nodes = [ranks[i : i + local_size] for i in range(0, world, local_size)]
    leaders = [node[0] for node in nodes]
    local_group = None
    for node in nodes:  # new_group is collective: every rank creates every group, in the same order
        created = dist.new_group(node)
        if me in node:
            local_group = created
    leader_group = dist.new_group(leaders)
    my_node = next(node for node in nodes if me in node)
    return HierarchicalState(local_group, my_node[0], leader_group if me in leaders else None, world, len(nodes), stats)


@counts_own_traffic
def hierarchical_allreduce_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all ranks in three stages (see the module docstring)."""
    buffer = bucket.buffer()
    is_leader = state.leader_group is not None
    local_size = state.world_size // state.num_groups
    if local_size > 1:
        with counting(state.stats, INTRA):
            dist.reduce(buffer, dst=state.leader, group=state.local_group)
    if is_leader and state.num_groups > 1:
        with counting(state.stats, INTER):
            dist.all_reduce(buffer, group=state.leader_group)
    if is_leader:
        buffer.div_(state.world_size)
    if local_size > 1:
        with counting(state.stats, INTRA):
            dist.broadcast(buffer, src=state.leader, group=state.local_group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
