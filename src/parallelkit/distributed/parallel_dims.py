"""All parallel degrees of a run, validated in one place, and the named device mesh built from them.

Every strategy goes through :class:`ParallelDims`: a plain DDP run is ``dp = world``, a 5D run is
``pp × dp × sharding × cp × tp``. Context parallelism (``cp``) splits each sequence over ``cp`` ranks, which
read the same batch (their data-parallel rank is the same) and hold the same parameters (their gradients are
averaged with the data-parallel ones). Expert parallelism (``ep``) is not a mesh axis of its own: experts are
spread over a slice of the data-parallel ranks (``dp × sharding``), so ``ep`` must divide that product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from parallelkit.errors import ConfigError

# Mesh axis names: the only spelling used anywhere in parallelkit.
PP = "pp"
DP = "dp"
SHARDING = "sharding"
TP = "tp"
CP = "cp"
EP = "ep"

MESH_AXES = (PP, DP, SHARDING, CP, TP)
# Outermost → innermost. The innermost axis gets adjacent ranks (same node, fastest links), so tensor
# parallel (the heaviest traffic) goes last, context parallel (a key/value ring per layer) next to it, and
# pipeline parallel (light point-to-point traffic) first.
DEFAULT_MESH_ORDER = (PP, DP, SHARDING, CP, TP)
# The data-parallel axes whose ranks average gradients, in mesh order: cp's ranks too (they saw other tokens).
GRADIENT_AXES = (DP, SHARDING, CP)


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees for ``world_size`` processes.

    Two forms of the one carrier of degrees: a *request* (:meth:`request`, ``world_size`` still unknown, at
    most one degree ``-1`` = "the remaining ranks"), which a strategy holds from its constructor on, and the
    *resolved* degrees for a world size (:meth:`resolve`, :meth:`from_degrees`), validated against it.

    Args:
        world_size: number of processes in the job.
        dp: data-parallel replicas (full copies of the model state).
        sharding: ranks that shard the model state inside one replica group (ZeRO / FSDP).
        tp: tensor-parallel degree.
        pp: pipeline stages.
        cp: context-parallel degree: ranks that hold parts of the same sequences.
        ep: expert-parallel degree; divides ``dp × sharding``.
        mesh_order: axis order of the device mesh, outermost first (an order without ``cp``, written before it
            existed, gets it just outside ``tp``).

    Example::

        dims = ParallelDims.from_degrees(8, dp=-1, tp=2, pp=2)   # dp = 2
        mesh = dims.build_mesh("cpu")
        dp_group = mesh.get_group("dp")
    """

    world_size: int | None
    dp: int = 1
    sharding: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    mesh_order: tuple[str, ...] = field(default=DEFAULT_MESH_ORDER)

    @classmethod
    def from_degrees(
        cls,
        world_size: int,
        *,
        dp: int = -1,
        sharding: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
    ) -> ParallelDims:
        """Resolve at most one ``-1`` among ``dp, sharding, cp, tp, pp`` to the remaining ranks, then validate."""
        _check_positive_int("world_size", world_size)
        degrees = {DP: dp, SHARDING: sharding, CP: cp, TP: tp, PP: pp}
        free = _check_requested(degrees)
        if free:
            fixed = math.prod(v for v in degrees.values() if v != -1)
            if world_size % fixed:
                raise ConfigError(
                    f"{_product_text(degrees, skip=free[0])} = {fixed} does not divide the {world_size} processes, "
                    f"so strategy.{free[0]}=-1 cannot take the remaining ranks. Pick degrees whose product divides "
                    f"{world_size}, or change trainer.devices."
                )
            degrees[free[0]] = world_size // fixed
        return cls(world_size=world_size, ep=ep, mesh_order=tuple(mesh_order), **degrees)

    @classmethod
    def request(
        cls,
        *,
        dp: int = -1,
        sharding: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
    ) -> ParallelDims:
        """The degrees a strategy asks for before the world size is known (``-1``: the remaining ranks).

        Each degree is checked now (a positive int, at most one ``-1``); :meth:`resolve` checks the product
        against the processes started.
        """
        return cls(world_size=None, dp=dp, sharding=sharding, tp=tp, pp=pp, ep=ep, cp=cp, mesh_order=tuple(mesh_order))

    def resolve(self, world_size: int) -> ParallelDims:
        """These degrees for ``world_size`` processes (a request's ``-1`` resolved), validated.

        Under torchrun an explicit ``dp`` that does not fit follows the world size (an elastic job that shrank or
        grew; :func:`parallelkit.distributed.elastic.elastic_degrees`)."""
        from parallelkit.distributed.elastic import elastic_degrees

        return type(self).from_degrees(world_size, **elastic_degrees(self.degrees, world_size), ep=self.ep, mesh_order=self.mesh_order)

    @property
    def is_resolved(self) -> bool:
        return self.world_size is not None

    def __post_init__(self) -> None:
        if not all(isinstance(axis, str) for axis in self.mesh_order):
            raise ConfigError(f"mesh_order must be a permutation of {list(MESH_AXES)}; got {list(self.mesh_order)}.")
        order = tuple(self.mesh_order)  # a list would make it unhashable
        if CP not in order and TP in order:  # an order written before cp existed: cp just outside tp, as by default
            order = order[:order.index(TP)] + (CP,) + order[order.index(TP):]
        object.__setattr__(self, "mesh_order", order)
        if sorted(self.mesh_order) != sorted(MESH_AXES):
            raise ConfigError(
                f"mesh_order must be a permutation of {list(MESH_AXES)}; got {list(self.mesh_order)}."
            )
        _check_positive_int("strategy.ep", self.ep)
        if self.world_size is None:  # a request: each degree alone; the product once the world size is known
            _check_requested(self.degrees)
            return
        _check_positive_int("world_size", self.world_size)
        for name in (DP, SHARDING, CP, TP, PP):
            _check_positive_int(f"strategy.{name}", getattr(self, name))
        product = self.dp * self.sharding * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ConfigError(
                f"{_product_text(self.degrees)} = {product}, but {self.world_size} processes were started. "
                f"The degrees must multiply to the number of processes (trainer.devices × trainer.num_nodes); "
                f"set one of them to -1 to take the remaining ranks."
            )
        if (self.dp * self.sharding) % self.ep:
            raise ConfigError(
                f"strategy.ep={self.ep} must divide dp({self.dp}) × sharding({self.sharding}) = "
                f"{self.dp * self.sharding}: experts are spread over data-parallel ranks."
            )
        if self.cp > 1:
            positions = [self.mesh_order.index(axis) for axis in GRADIENT_AXES]
            if positions != list(range(positions[0], positions[0] + len(positions))):
                raise ConfigError(
                    f"strategy.mesh_order={list(self.mesh_order)} with strategy.cp={self.cp}: dp, sharding and cp must be "
                    "adjacent and in that order (their ranks average gradients together, as one flattened mesh axis). "
                    f"For example {list(DEFAULT_MESH_ORDER)}."
                )

    # ------------------------------------------------------------------ views
    @property
    def degrees(self) -> dict[str, int]:
        """The mesh degrees in canonical order (``dp, sharding, cp, tp, pp``)."""
        return {DP: self.dp, SHARDING: self.sharding, CP: self.cp, TP: self.tp, PP: self.pp}

    def as_dict(self) -> dict[str, int]:
        """All six degrees, as written to ``summary.json``."""
        return {DP: self.dp, SHARDING: self.sharding, CP: self.cp, TP: self.tp, PP: self.pp, EP: self.ep}

    # Which techniques the degrees turn on (a request's -1 counts as on: it may take more than one rank).
    @property
    def tp_enabled(self) -> bool:
        return self.tp != 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp != 1

    @property
    def sharding_enabled(self) -> bool:
        return self.sharding != 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep != 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp != 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: replicas × shards."""
        return self.dp * self.sharding

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in self.mesh_order)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every mesh axis (row-major over ``mesh_order``), plus its ``ep`` index."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        coords: dict[str, int] = {}
        rest = rank
        for axis, size in zip(reversed(self.mesh_order), reversed(self.mesh_shape)):
            coords[axis] = rest % size
            rest //= size
        coords[EP] = self.data_parallel_rank(rank, coords) % self.ep
        return {axis: coords[axis] for axis in (DP, SHARDING, CP, TP, PP, EP)}

    def data_parallel_rank(self, rank: int, coords: dict[str, int] | None = None) -> int:
        """Index of this rank's data shard: ranks that differ only in ``cp``/``tp``/``pp`` read the same batch (``cp``
        ranks then keep their part of each sequence)."""
        coords = coords if coords is not None else self.coordinates(rank)
        return coords[DP] * self.sharding + coords[SHARDING]

    # ------------------------------------------------------------------ expert-parallel groups
    def data_parallel_groups(self) -> list[list[int]]:
        """Global ranks that hold different tokens of the same model part: all ``dp × sharding × cp`` ranks, per ``tp, pp``."""
        return self._groups_by(lambda c: (c[PP], c[TP]), lambda c: (self.data_parallel_rank(0, c), c[CP]))

    def expert_parallel_groups(self) -> list[list[int]]:
        """Global ranks that share their tokens' experts: ``ep`` consecutive data-parallel ranks, per ``cp, tp, pp``.

        Every rank is in exactly one group; within a group the ranks are ordered by their ``ep`` index.
        """
        return self._groups_by(lambda c: (c[PP], c[TP], c[CP], self.data_parallel_rank(0, c) // self.ep), lambda c: c[EP])

    def expert_data_parallel_groups(self) -> list[list[int]]:
        """Global ranks that hold the same experts (same ``ep`` index, any ``cp``): their expert gradients are averaged."""
        return self._groups_by(lambda c: (c[PP], c[TP], c[EP]), lambda c: (self.data_parallel_rank(0, c), c[CP]))

    def _groups_by(self, key, order) -> list[list[int]]:
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            groups.setdefault(key(coords), []).append((order(coords), rank))
        return [[rank for _, rank in sorted(members)] for _, members in sorted(groups.items())]

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str):
        """Build the named :class:`~torch.distributed.device_mesh.DeviceMesh` (all five axes, size-1 ones too).

        Every axis is always present so code can ask for ``mesh["tp"]`` without checking whether tensor
        parallelism is on. Requires an initialised default process group of ``world_size`` ranks.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialised default process group")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"The process group has {dist.get_world_size()} ranks but the parallel degrees were planned for "
                f"{self.world_size}."
            )
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=tuple(self.mesh_order))


#: Lightning's ``ModelParallelStrategy`` names for the data-parallel and tensor-parallel ranks.
LIGHTNING_AXES = {"data_parallel": (DP, SHARDING), "tensor_parallel": (TP,)}


def add_lightning_axis_names(mesh: Any) -> None:
    """Also name the mesh's axes as Lightning's ``ModelParallelStrategy`` does, so that a LightningModule's
    ``configure_model`` written for it (``fully_shard(layer, mesh=self.device_mesh["data_parallel"])``) runs
    unchanged: ``data_parallel`` is ``(dp, sharding)`` flattened, ``tensor_parallel`` is ``tp``. Skipped where a
    custom ``mesh_order`` puts ``dp`` and ``sharding`` apart (they cannot be flattened into one axis)."""
    import warnings

    # torch warns that slicing a flattened axis from the root mesh (what such code does) may be deprecated.
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    order = list(mesh.mesh_dim_names)
    for name, axes in LIGHTNING_AXES.items():
        positions = [order.index(axis) for axis in axes]
        if positions == list(range(positions[0], positions[0] + len(positions))):
            mesh[axes]._flatten(name)


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} should be an int greater than 0. Got {value!r}.")


def _check_requested(degrees: dict[str, int]) -> list[str]:
    """Each requested degree a positive int or -1, at most one -1; returns the names of the -1 degrees."""
    for name, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise ConfigError(f"strategy.{name} must be a positive integer or -1 (the remaining ranks). Got {value!r}.")
    free = [name for name, value in degrees.items() if value == -1]
    if len(free) > 1:
        raise ConfigError(
            f"Only one of dp, sharding, cp, tp, pp may be -1 (the remaining ranks); got -1 for {', '.join(free)}. "
            "Set all but one of them explicitly."
        )
    return free


def _product_text(degrees: dict[str, int], skip: str | None = None) -> str:
    return " × ".join(f"{name}({value})" for name, value in degrees.items() if name != skip)
