"""ParallelDims: degree resolution and validation, and agreement with torch's DeviceMesh.

Meshes of up to 64 ranks are built in this one process with torch's ``fake`` process-group backend:
the group is initialised once per simulated rank, so ``mesh.get_coordinate()`` and ``mesh.get_group()``
answer as they would on that rank of a real job. No collective is ever run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, defaultdict
from contextlib import contextmanager

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallelkit.distributed.parallel_dims import (
    CP,
    DEFAULT_MESH_ORDER,
    DP,
    EP,
    MESH_AXES,
    PP,
    SHARDING,
    TP,
    ParallelDims,
)
from parallelkit.errors import ConfigError

# (world_size, degrees, mesh_order): plans whose mesh is checked rank by rank.
MESH_CASES = [
    pytest.param(8, dict(dp=-1, tp=2, pp=2), DEFAULT_MESH_ORDER, id="w8-dp_rest-tp2-pp2"),
    pytest.param(12, dict(dp=3, tp=2, pp=2), (DP, PP, TP, SHARDING), id="w12-order-dp,pp,tp,sharding"),
    pytest.param(16, dict(dp=-1, sharding=4, tp=2), DEFAULT_MESH_ORDER, id="w16-sharding4-tp2"),
    pytest.param(64, dict(pp=2, dp=2, sharding=2, tp=8), DEFAULT_MESH_ORDER, id="w64-4d-default-order"),
    pytest.param(64, dict(pp=2, dp=2, sharding=2, tp=8), (TP, SHARDING, PP, DP), id="w64-4d-order-tp,sharding,pp,dp"),
    pytest.param(32, dict(pp=2, dp=2, sharding=2, cp=2, tp=2), DEFAULT_MESH_ORDER, id="w32-5d-default-order"),
    pytest.param(16, dict(dp=2, cp=4, tp=2), (TP, DP, SHARDING, CP, PP), id="w16-cp4-order-tp,dp,sharding,cp,pp"),
]


@contextmanager
def fake_world(rank: int, world_size: int):
    """A default process group of ``world_size`` fake ranks, seen from ``rank``; always torn down."""
    assert not dist.is_initialized(), "a previous test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_for_rank(dims: ParallelDims, rank: int):
    """(mesh_dim_names, coordinate of ``rank``, {axis: ranks of this rank's group on that axis})."""
    with fake_world(rank, dims.world_size):
        mesh = dims.build_mesh("cpu")
        groups = {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in mesh.mesh_dim_names}
        return tuple(mesh.mesh_dim_names), tuple(mesh.get_coordinate()), tuple(mesh.shape), groups


def mesh_positions(dims: ParallelDims) -> dict[int, dict[str, int]]:
    """Every rank's position in the mesh tensor (an independent source of coordinates)."""
    with fake_world(0, dims.world_size):
        mesh = dims.build_mesh("cpu")
        ranks = mesh.mesh
        names = mesh.mesh_dim_names
    positions = {}
    for index in itertools.product(*(range(n) for n in ranks.shape)):
        positions[int(ranks[index])] = dict(zip(names, index))
    return positions


# --------------------------------------------------------------------------- constants


def test_axis_constants_are_the_public_names():
    # DESIGN §3: strategy.dp / strategy.sharding / strategy.tp / strategy.pp / strategy.ep (and .cp) are the CLI contract.
    assert (DP, SHARDING, CP, TP, PP, EP) == ("dp", "sharding", "cp", "tp", "pp", "ep")
    assert set(MESH_AXES) == {DP, SHARDING, CP, TP, PP}
    assert EP not in MESH_AXES  # ep spreads experts over dp × sharding; it is not a mesh axis
    assert sorted(DEFAULT_MESH_ORDER) == sorted(MESH_AXES)
    assert DEFAULT_MESH_ORDER[-1] == TP and DEFAULT_MESH_ORDER[0] == PP
    assert DEFAULT_MESH_ORDER[-2] == CP  # context parallel beside tp: a ring per layer wants adjacent ranks


def test_as_dict_has_the_summary_keys():
    dims = ParallelDims.from_degrees(8, dp=2, sharding=2, tp=2, ep=2)
    assert dims.as_dict() == {"dp": 2, "sharding": 2, "cp": 1, "tp": 2, "pp": 1, "ep": 2}
    assert dims.data_parallel_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.dp = 4  # type: ignore[misc]


# --------------------------------------------------------------------------- -1 resolution


@pytest.mark.parametrize(
    "world, degrees, free",
    [
        (8, dict(dp=-1, tp=2, pp=2), "dp"),
        (8, dict(tp=2, pp=2), "dp"),  # dp defaults to -1
        (16, dict(dp=2, tp=-1, pp=2), "tp"),
        (24, dict(dp=2, sharding=-1, tp=3), "sharding"),
        (12, dict(dp=3, pp=-1, tp=2), "pp"),
        (7, dict(dp=-1), "dp"),
    ],
)
def test_minus_one_takes_the_remaining_ranks(world, degrees, free):
    dims = ParallelDims.from_degrees(world, **degrees)
    given = {axis: value for axis, value in degrees.items() if value != -1}
    expected_free = world // math.prod(given.values())
    assert getattr(dims, free) == expected_free
    for axis, value in given.items():
        assert getattr(dims, axis) == value
    assert dims.dp * dims.sharding * dims.tp * dims.pp == world


def test_at_most_one_minus_one():
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(8, dp=-1, tp=-1)
    message = str(err.value)
    assert "dp" in message and "tp" in message and "-1" in message
    with pytest.raises(ConfigError):
        ParallelDims.from_degrees(8, dp=2, sharding=-1, pp=-1)


def test_minus_one_needs_a_divisor_of_the_world():
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(8, dp=-1, tp=3)
    message = str(err.value)
    for factor in ("sharding(1)", "tp(3)", "pp(1)"):
        assert factor in message
    assert "8" in message and "strategy.dp=-1" in message


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_degrees_must_be_positive_ints_or_minus_one(bad):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(8, dp=-1, tp=bad)
    assert "strategy.tp" in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize("bad", [0, -1, 2.0, False])
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError):
        ParallelDims.from_degrees(bad, dp=-1)
    with pytest.raises(ConfigError):
        ParallelDims(world_size=bad)


# --------------------------------------------------------------------------- product check


@pytest.mark.parametrize(
    "world, degrees",
    [
        (6, dict(dp=2, sharding=1, tp=2, pp=2)),
        (16, dict(dp=2, sharding=2, tp=2, pp=1)),
        (4, dict(dp=1, sharding=1, tp=8, pp=1)),
    ],
)
def test_product_error_names_every_factor(world, degrees):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(world, **degrees)
    message = str(err.value)
    for axis, value in degrees.items():
        assert f"{axis}({value})" in message, message
    product = math.prod(degrees.values())
    assert f"= {product}" in message
    assert f"{world} processes" in message
    # The constructor (already-resolved degrees) reports the same way.
    with pytest.raises(ConfigError) as err2:
        ParallelDims(world_size=world, **degrees)
    for axis, value in degrees.items():
        assert f"{axis}({value})" in str(err2.value)


# --------------------------------------------------------------------------- ep


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_dividing_dp_times_sharding_is_accepted(ep):
    dims = ParallelDims.from_degrees(16, dp=2, sharding=2, tp=2, pp=2, ep=ep)
    assert dims.ep == ep


@pytest.mark.parametrize("ep", [3, 8, 0, -1])
def test_ep_must_divide_dp_times_sharding(ep):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(16, dp=2, sharding=2, tp=2, pp=2, ep=ep)
    assert "ep" in str(err.value)
    if ep > 0:
        assert "dp(2)" in str(err.value) and "sharding(2)" in str(err.value)


def test_ep_coordinate_splits_each_data_parallel_slice_evenly():
    dims = ParallelDims.from_degrees(32, dp=4, sharding=2, tp=2, pp=2, ep=4)
    per_slice: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        per_slice[coords[TP], coords[PP]][coords[EP]] += 1
    share = dims.dp * dims.sharding // dims.ep
    for counts in per_slice.values():
        assert counts == {e: share for e in range(dims.ep)}


# --------------------------------------------------------------------------- mesh_order


@pytest.mark.parametrize(
    "order",
    [
        (PP, DP, TP),  # missing an axis
        (PP, DP, SHARDING, TP, EP),  # ep is not a mesh axis
        (PP, DP, DP, TP),  # duplicate
        ("pp", "dp", "fsdp", "tp"),  # unknown name
    ],
)
def test_mesh_order_must_be_a_permutation_of_the_axes(order):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_degrees(8, dp=-1, tp=2, mesh_order=order)
    assert "mesh_order" in str(err.value)


def test_mesh_order_accepts_any_permutation_and_a_list():
    for order in itertools.permutations(MESH_AXES):
        dims = ParallelDims.from_degrees(24, dp=-1, sharding=2, tp=3, mesh_order=list(order))
        assert dims.mesh_order == order
        assert dims.mesh_shape == tuple(getattr(dims, axis) for axis in order)


# --------------------------------------------------------------------------- the mesh


@pytest.mark.parametrize("world, degrees, order", MESH_CASES)
def test_mesh_shape_names_and_coordinates_match_device_mesh(world, degrees, order):
    dims = ParallelDims.from_degrees(world, mesh_order=order, **degrees)
    order = dims.mesh_order  # a four-axis order (written before cp) gets cp just outside tp
    expected_shape = tuple(getattr(dims, axis) for axis in order)
    for rank in range(world):
        names, coordinate, shape, _ = mesh_for_rank(dims, rank)
        assert names == tuple(order)
        assert shape == expected_shape
        ours = dims.coordinates(rank)
        assert tuple(ours[axis] for axis in names) == coordinate, f"rank {rank}"


def test_negative_control_reversed_coordinates_disagree_with_the_mesh():
    """A coordinate function that gets the axis order backwards must be caught by the comparison above."""
    dims = ParallelDims.from_degrees(64, pp=2, dp=2, sharding=2, tp=8)
    wrong = dataclasses.replace(dims, mesh_order=tuple(reversed(dims.mesh_order)))
    mismatches = 0
    for rank in range(dims.world_size):
        names, coordinate, _, _ = mesh_for_rank(dims, rank)
        bad = wrong.coordinates(rank)
        if tuple(bad[axis] for axis in names) != coordinate:
            mismatches += 1
    assert mismatches > 0


@pytest.mark.parametrize("world, degrees, order", MESH_CASES)
def test_axis_groups_hold_the_ranks_that_differ_only_on_that_axis(world, degrees, order):
    dims = ParallelDims.from_degrees(world, mesh_order=order, **degrees)
    positions = mesh_positions(dims)
    for rank in (0, world // 2 + 1, world - 1):
        _, _, _, groups = mesh_for_rank(dims, rank)
        for axis, members in groups.items():
            expected = sorted(
                other
                for other, pos in positions.items()
                if all(pos[a] == positions[rank][a] for a in pos if a != axis)
            )
            assert sorted(members) == expected, (rank, axis)
            assert len(members) == getattr(dims, axis)


@pytest.mark.parametrize("world, tp", [(8, 2), (16, 4), (64, 8)])
def test_tp_groups_are_adjacent_ranks_with_the_default_order(world, tp):
    dims = ParallelDims.from_degrees(world, dp=-1, tp=tp, pp=2)
    for rank in range(world):
        _, _, _, groups = mesh_for_rank(dims, rank)
        first = rank - rank % tp
        assert sorted(groups[TP]) == list(range(first, first + tp))


def test_build_mesh_checks_the_process_group():
    dims = ParallelDims.from_degrees(8, dp=-1, tp=2)
    with pytest.raises(RuntimeError):
        dims.build_mesh("cpu")
    with fake_world(0, 4):
        with pytest.raises(ConfigError) as err:
            dims.build_mesh("cpu")
    assert "4" in str(err.value) and "8" in str(err.value)


# --------------------------------------------------------------------------- data-parallel rank


@pytest.mark.parametrize("world, degrees, order", MESH_CASES)
def test_data_parallel_rank_shared_across_tp_pp_and_covers_every_shard(world, degrees, order):
    dims = ParallelDims.from_degrees(world, mesh_order=order, **degrees)
    positions = mesh_positions(dims)
    shards = dims.dp * dims.sharding
    by_dp_coords: dict[tuple[int, int], set[int]] = defaultdict(set)
    by_slice: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for rank, pos in positions.items():
        dp_rank = dims.data_parallel_rank(rank)
        by_dp_coords[pos[DP], pos[SHARDING]].add(dp_rank)
        by_slice[pos[CP], pos[TP], pos[PP]].append(dp_rank)
    # Ranks that differ only in cp/tp/pp read the same shard (cp ranks then keep their part of each sequence) ...
    assert all(len(dp_ranks) == 1 for dp_ranks in by_dp_coords.values())
    # ... different (dp, sharding) coordinates read different shards ...
    assert len({next(iter(s)) for s in by_dp_coords.values()}) == shards
    # ... and each (cp, tp, pp) slice covers shards 0 .. dp*sharding-1 exactly once.
    assert len(by_slice) == dims.cp * dims.tp * dims.pp
    for dp_ranks in by_slice.values():
        assert sorted(dp_ranks) == list(range(shards))


def test_coordinates_rejects_ranks_outside_the_world():
    dims = ParallelDims.from_degrees(4, dp=-1)
    for rank in (-1, 4):
        with pytest.raises(ValueError):
            dims.coordinates(rank)



# --------------------------------------------------------------------------- context parallel


def test_an_order_written_before_cp_gets_it_just_outside_tp():
    dims = ParallelDims.from_degrees(8, dp=2, cp=2, tp=2, mesh_order=[PP, DP, SHARDING, TP])
    assert dims.mesh_order == DEFAULT_MESH_ORDER
    assert ParallelDims.from_degrees(4, dp=-1, mesh_order=(TP, PP, DP, SHARDING)).mesh_order == (CP, TP, PP, DP, SHARDING)


def test_cp_needs_the_gradient_axes_adjacent():
    """dp, sharding and cp average gradients as one flattened axis: they must be adjacent, in that order."""
    with pytest.raises(ConfigError, match="dp, sharding and cp must be adjacent"):
        ParallelDims.from_degrees(8, dp=2, cp=2, tp=2, mesh_order=(DP, PP, SHARDING, CP, TP))
    # the same order is fine without cp (nothing to flatten)
    ParallelDims.from_degrees(8, dp=2, tp=2, pp=2, mesh_order=(DP, PP, SHARDING, CP, TP))


def test_cp_takes_minus_one_and_multiplies_into_the_world():
    assert ParallelDims.from_degrees(8, dp=2, cp=-1, tp=2).cp == 2
    with pytest.raises(ConfigError, match=r"cp\(3\)"):
        ParallelDims.from_degrees(8, dp=2, cp=3, tp=1)


def test_token_groups_span_cp_and_expert_groups_stay_within_one_cp_index():
    """Ranks holding different tokens of the same model part (MoE routing, capacity): dp × sharding × cp; an expert
    group's ranks share a cp index (they exchange the tokens of the same sequence part); ranks holding the same
    experts average their gradients over every cp index too."""
    dims = ParallelDims.from_degrees(8, dp=4, cp=2, ep=2)
    coords = {r: dims.coordinates(r) for r in range(8)}
    assert dims.data_parallel_groups() == [list(range(8))]
    for group in dims.expert_parallel_groups():
        assert len(group) == 2 and len({coords[r][CP] for r in group}) == 1
    for group in dims.expert_data_parallel_groups():
        assert len(group) == 4 and {coords[r][CP] for r in group} == {0, 1} and len({coords[r][EP] for r in group}) == 1
