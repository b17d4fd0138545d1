"""The machine the planner costs layouts on: a hardware profile (YAML), named or calibrated.

A profile says how fast one rank computes and how fast groups of ranks communicate:

- **matmul**: achievable FLOP/s of a large GEMM per compute dtype (``fp32``, ``bf16``), HBM/DRAM bandwidth and
  a fixed cost per kernel. A GEMM ``(m, n, k)`` takes ``max(2mnk / flops, bytes / bandwidth) + overhead`` (a
  roofline: small or thin GEMMs are memory- or launch-bound), unless the profile measured that very shape.
- **collectives**: per operation and group size, ``latency + bytes sent / bandwidth`` (measured by
  ``--calibrate``), else from the link figures: intra-node within a node, inter-node for a group spanning nodes.
  ``inter_node.bandwidth`` is **per GPU**: the bytes/s one GPU's share of the node's network adapters moves (a DGX
  A100's HDR adapter per GPU: 21.2 GB/s). A ring collective (all-reduce, all-gather, reduce-scatter) across nodes runs
  one ring per adapter, each crossing the node boundary once, so its bus bandwidth is the **node aggregate** of the
  group's members on the node: ``members per node × per-GPU`` (at most the intra-node bus bandwidth); nccl-tests
  reports exactly that figure as ``busbw`` (84.8 GB/s for 4 HDR adapters per node, NVIDIA/nccl-tests#119). A
  point-to-point send and an all-to-all move each GPU's own bytes through its own share: per GPU.
- **host time**: seconds a rank's host spends per step, per micro-batch, per block and step and per block and
  micro-batch besides the kernels' work (measured by ``--calibrate``; 0 in the GPU profiles, where the host runs ahead
  of the device): :meth:`host_time`.
- **host time of tensor parallelism, FSDP2 and pipelines** (``tp_host_overhead``, ``sharding_host_overhead``,
  ``pp_host_overhead``): CPU seconds per step, per micro-batch and per block and micro-batch each mechanism adds on a
  rank of a group of ``g`` (DTensor dispatch, autograd through it, a pipeline schedule's actions, the collectives' and
  sends' own CPU work), measured by ``--calibrate`` on tiny GPTs; absent in the GPU profiles (the host runs ahead of
  the device there), where ``dtensor_op_overhead`` (0) stands in.
- **host time of data parallelism** (``dp_host_overhead``): CPU seconds per step and per block a rank of a
  gradient all-reduce group of ``g`` spends beyond one process's step — the flat buckets, gloo's own work moving the
  gradients and waking ``2(g − 1)`` times per ring — measured by ``--calibrate`` on the workload's own blocks (their
  gradient bytes decide it: 3.3 MB per rank took 8 / 11 / 20 ms per step at g = 2 / 4 / 8 on 2 CPUs).
- **optimizer time per parameter element** (``optimizer_element_time``): one optimizer step of the workload's
  optimizer on a block's tensors, per element (``--calibrate``); 0 in the GPU profiles, where the step streams the
  weights, gradients and moments at the memory bandwidth (fused/multi-tensor kernels). On a CPU, PyTorch's default
  AdamW loops over the tensors with several element-wise passes each: 7x the streaming estimate on a 2-CPU VM.
- **compute scale**: a block's kernels inside a training step over the cost model's compute of it from the measured
  GEMMs and bandwidth (``--calibrate`` on the workload's own GPT; 1 in the GPU profiles, not measured there).
- **compute units per node**: fewer than the ranks on a node means the ranks share them (CPU processes on
  fewer cores): a step then takes at least the node's total compute divided by the units.

Named profiles live in ``parallelkit/planner/profiles/`` (``strategy.hardware=a100_80gb_8x``); a calibrated
one is a path (``strategy.hardware=hardware_HOST.yaml``), written by ``python -m parallelkit.plan --calibrate``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError

PROFILES = Path(__file__).parent / "profiles"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
HOST_TERMS = ("step_overhead", "microbatch_overhead", "layer_step_overhead", "layer_overhead")  # host seconds (calibrated)
# {g: (per step, per micro-batch, per block and micro-batch)}; dp's once per step: (per step, 0, per block)
PARALLEL_HOST_TERMS = ("tp_host_overhead", "sharding_host_overhead", "pp_host_overhead", "dp_host_overhead")
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # one ring per network adapter across nodes


@dataclass(frozen=True)
class Link:
    """One rank's link: bytes/s it sends, seconds per message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Hardware:
    """A hardware profile (see the module docstring). Bandwidths in bytes/s, times in seconds, memory in bytes.

    Args:
        name: the profile's name.
        devices_per_node: ranks per node (ranks ``k·n … k·n + n − 1`` share node ``k``).
        memory_per_device: bytes one rank may hold.
        memory_reserved: bytes of that the runtime keeps for itself (CUDA context, communication buffers).
        matmul_flops: achievable GEMM FLOP/s per compute dtype.
        memory_bandwidth: achievable bytes/s of memory-bound kernels.
        kernel_overhead: seconds every kernel costs besides its work (launch, dispatch).
        step_overhead: host seconds every rank spends per optimizer step besides the model's kernels (the training
            loop, optimizer bookkeeping, data loading; measured by ``--calibrate``; 0 in the GPU profiles, where the
            host runs ahead of the device).
        microbatch_overhead: host seconds per micro-batch besides the blocks (its loop, embedding, head, loss).
        layer_step_overhead: host seconds per block held and step (per-parameter work: optimizer, hooks, clipping).
        layer_overhead: host seconds per block and micro-batch (module calls, autograd, forward and backward).
        dtensor_op_overhead: extra seconds an operation on a DTensor (tensor parallel, FSDP2's sharded parameters)
            costs over the same operation on a plain tensor (dispatch; measured by ``--calibrate``; 0 in the GPU
            profiles, where it runs ahead of the device's work).
        tp_host_overhead / sharding_host_overhead / pp_host_overhead: ``{g: [per step, per micro-batch, per block and
            micro-batch]}`` CPU seconds tensor parallelism / FSDP2 / a pipeline over ``g`` ranks add to a rank's step
            over one process's step of the rank's blocks and micro-batches (measured by ``--calibrate``; empty in the
            GPU profiles). Where present for a layout, tp's and sharding's replace ``dtensor_op_overhead``'s estimate.
        dp_host_overhead: ``{g: [per step, 0, per block]}`` CPU seconds a gradient all-reduce over ``g`` ranks adds to
            a rank's step (once per step, whatever the micro-batches; the workload's blocks, measured by ``--calibrate``).
        optimizer_element_time: seconds of one optimizer step per parameter element (measured by ``--calibrate``;
            0: the step streams its bytes at ``memory_bandwidth``).
        compute_scale: a block's kernels in a training step over the cost model's compute of it (measured by
            ``--calibrate``; 1.0 in the GPU profiles).
        intra_node / inter_node: link figures; ``inter_node.bandwidth`` per GPU (its share of the node's network
            adapters), not the node's aggregate (see the module docstring).
        compute_units_per_node: independent compute units the node's ranks share (None: one per rank).
        collectives: ``{op: {group_size: [latency, bandwidth]}}`` measured inside a node.
        matmul_measured: ``{"m,n,k,dtype": seconds}`` measured GEMM times.
        backend: the communication backend the figures are for.
        sources: where every figure comes from.
    """

    name: str
    devices_per_node: int
    memory_per_device: float
    matmul_flops: dict[str, float]
    memory_bandwidth: float
    intra_node: Link
    inter_node: Link
    kernel_overhead: float = 0.0
    step_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    layer_step_overhead: float = 0.0
    layer_overhead: float = 0.0
    dtensor_op_overhead: float = 0.0
    memory_reserved: float = 0.0
    tp_host_overhead: dict[int, tuple[float, ...]] = field(default_factory=dict)
    sharding_host_overhead: dict[int, tuple[float, ...]] = field(default_factory=dict)
    pp_host_overhead: dict[int, tuple[float, ...]] = field(default_factory=dict)
    dp_host_overhead: dict[int, tuple[float, ...]] = field(default_factory=dict)
    optimizer_element_time: float = 0.0
    compute_scale: float = 1.0
    compute_units_per_node: float | None = None
    collectives: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    matmul_measured: dict[str, float] = field(default_factory=dict)
    backend: str = "nccl"
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _positive("devices_per_node", self.devices_per_node, integer=True)
        _positive("memory_per_device", self.memory_per_device)
        _positive("memory_bandwidth", self.memory_bandwidth)
        if not self.matmul_flops:
            raise ConfigError("strategy.hardware.matmul_flops needs at least one dtype (fp32, bf16) with its FLOP/s.")
        for dtype, value in self.matmul_flops.items():
            _positive(f"matmul_flops.{dtype}", value)
        for name in ("intra_node", "inter_node"):
            link = getattr(self, name)
            _positive(f"{name}.bandwidth", link.bandwidth)
            _non_negative(f"{name}.latency", link.latency)
        _non_negative("kernel_overhead", self.kernel_overhead)
        for name in HOST_TERMS:
            _non_negative(name, getattr(self, name))
        _non_negative("dtensor_op_overhead", self.dtensor_op_overhead)
        _non_negative("optimizer_element_time", self.optimizer_element_time)
        _non_negative("memory_reserved", self.memory_reserved)
        _positive("compute_scale", self.compute_scale)
        for name in PARALLEL_HOST_TERMS:
            for g, terms in getattr(self, name).items():
                _positive(f"{name} group size", g, integer=True)
                if len(terms) != 3:
                    raise ConfigError(f"strategy.hardware.{name}[{g}] takes [per step, per micro-batch, per block and micro-batch] seconds. Got {terms!r}.")
                for value in terms:
                    _non_negative(f"{name}[{g}]", value)
        if self.memory_reserved >= self.memory_per_device:
            raise ConfigError(f"strategy.hardware.memory_reserved={self.memory_reserved:.3g} leaves nothing of memory_per_device={self.memory_per_device:.3g}.")
        if self.compute_units_per_node is not None:
            _positive("compute_units_per_node", self.compute_units_per_node)
        for op in self.collectives:
            if op not in OPS:
                raise ConfigError(f"strategy.hardware.collectives has an unknown operation {op!r}; it takes {', '.join(OPS)}.")

    # ---------------------------------------------------------------- derived
    @property
    def usable_memory(self) -> float:
        return self.memory_per_device - self.memory_reserved

    @property
    def units_per_node(self) -> float:
        return self.compute_units_per_node or self.devices_per_node

    def flops(self, dtype: str) -> float:
        return self.matmul_flops.get(dtype) or self.matmul_flops.get("fp32") or next(iter(self.matmul_flops.values()))

    def gemm_time(self, m: float, n: float, k: float, elem: int, dtype: str, batch: float = 1.0) -> float:
        """Seconds of ``batch`` GEMMs ``(m × k) @ (k × n)`` (see the module docstring)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        measured = self.matmul_measured.get(f"{int(m)},{int(n)},{int(k)},{dtype}")
        if measured is not None and batch == int(batch):
            return measured * batch
        work = 2.0 * m * n * k / self.flops(dtype)
        traffic = elem * (m * k + k * n + m * n) / self.memory_bandwidth
        return batch * (max(work, traffic) + self.kernel_overhead)

    def memory_time(self, nbytes: float, kernels: float = 0.0) -> float:
        """Seconds of memory-bound work moving ``nbytes`` in ``kernels`` kernels."""
        return nbytes / self.memory_bandwidth + kernels * self.kernel_overhead

    def collective_time(self, op: str, nbytes: float, group: int, across_nodes: bool, per_node: int = 1) -> float:
        """Seconds of one collective on a buffer of ``nbytes`` (the full tensor; p2p: the message) over ``group`` ranks.

        Bytes each rank sends (ring): all-reduce ``2(g−1)/g·n``, all-gather / reduce-scatter / all-to-all ``(g−1)/g·n``,
        p2p ``n``. A measured fit for ``(op, g)`` inside a node is used as is; otherwise the link's latency counts
        ``1 + log2 g`` times (tree-like start-up) and its bandwidth carries the bytes. Across nodes, a ring operation of
        a group with ``per_node`` members on each node gets ``per_node`` GPUs' share of the network (the module
        docstring), at most the intra-node bus bandwidth.
        """
        if group <= 1 or nbytes <= 0:
            return 0.0
        sent = {"all_reduce": 2 * (group - 1) / group, "p2p": 1.0}.get(op, (group - 1) / group) * nbytes
        fit = None if across_nodes else _nearest_fit(self.collectives.get(op, {}), group)
        if fit is not None:
            latency, bandwidth = fit
            return latency + sent / bandwidth
        link = self.inter_node if across_nodes else self.intra_node
        bandwidth = self.ring_bandwidth(per_node) if across_nodes and op in RING_OPS else link.bandwidth
        return link.latency * (1 + math.log2(group)) + sent / bandwidth

    def ring_bandwidth(self, per_node: int) -> float:
        """Bus bandwidth of a ring collective across nodes whose group has ``per_node`` members on each node: their
        share of the node's network adapters (``per_node × inter_node.bandwidth``), at most the intra-node figure."""
        return min(max(1, per_node) * self.inter_node.bandwidth, max(self.intra_node.bandwidth, self.inter_node.bandwidth))

    def host_time(self, blocks: int, microbatches: int) -> float:
        """Host seconds of one step of a rank holding ``blocks`` blocks and running ``microbatches`` micro-batches."""
        return (self.step_overhead + microbatches * self.microbatch_overhead
                + blocks * (self.layer_step_overhead + microbatches * self.layer_overhead))

    def parallel_host_time(self, axis: str, group: int, blocks: int, microbatches: float) -> float | None:
        """CPU seconds tensor parallelism (``axis="tp"``), FSDP2 (``"sharding"``), a pipeline (``"pp"``) or the gradient
        all-reduce (``"dp"``, once per step: ``microbatches=1``) over ``group``
        ranks adds to a rank's step of ``blocks`` blocks and ``microbatches`` micro-batches; None where not measured (the nearest
        measured group size stands in for another)."""
        fits = {g: tuple(v) for g, v in getattr(self, f"{axis}_host_overhead").items()}
        if group <= 1 or not fits:
            return None
        per_step, per_microbatch, per_block = _nearest_fit(fits, group)  # type: ignore[misc]
        return per_step + microbatches * (per_microbatch + blocks * per_block)

    def with_overrides(self, **values: Any) -> Hardware:
        return replace(self, **values)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sources"] = list(self.sources)
        out["collectives"] = {op: {int(g): list(v) for g, v in by_g.items()} for op, by_g in self.collectives.items()}
        for name in PARALLEL_HOST_TERMS:
            out[name] = {int(g): list(v) for g, v in getattr(self, name).items()}
        return out


def _nearest_fit(fits: dict[int, tuple[float, float]], group: int) -> tuple[float, float] | None:
    if not fits:
        return None
    if group in fits:
        return fits[group]
    # A group size not measured: the nearest measured size's figures (latency grows slowly with g on one node).
    nearest = min(fits, key=lambda g: (abs(math.log2(g) - math.log2(group)), -g))
    return fits[nearest]


def _positive(name: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"strategy.hardware.{name} should be a {'positive integer' if integer else 'number greater than 0'}. Got {value!r}.")


def _non_negative(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"strategy.hardware.{name} should be a number ≥ 0. Got {value!r}.")


# ------------------------------------------------------------------------------------ loading and saving
def from_dict(data: dict[str, Any], where: str) -> Hardware:
    """A :class:`Hardware` from a profile's mapping (YAML), every field checked."""
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown hardware profile keys {unknown}; a profile takes {sorted(known)}.")
    missing = sorted(f.name for f in fields(Hardware) if f.name in
                     ("name", "devices_per_node", "memory_per_device", "matmul_flops", "memory_bandwidth", "intra_node", "inter_node")
                     and f.name not in data)
    if missing:
        raise ConfigError(f"{where}: the hardware profile lacks {missing}.")
    values = dict(data)
    try:
        for name in ("intra_node", "inter_node"):
            values[name] = Link(float(values[name]["bandwidth"]), float(values[name]["latency"]))
        values["matmul_flops"] = {str(k): float(v) for k, v in dict(values["matmul_flops"]).items()}
        for name in ("memory_per_device", "memory_bandwidth", "kernel_overhead", *HOST_TERMS, "dtensor_op_overhead", "optimizer_element_time",
                     "memory_reserved"):
            if name in values:
                values[name] = float(values[name])
        values["collectives"] = {str(op): {int(g): (float(v[0]), float(v[1])) for g, v in dict(by_g).items()}
                                 for op, by_g in dict(values.get("collectives") or {}).items()}
        for name in PARALLEL_HOST_TERMS:
            values[name] = {int(g): tuple(float(x) for x in v) for g, v in dict(values.get(name) or {}).items()}
        if "compute_scale" in values:
            values["compute_scale"] = float(values["compute_scale"])
        values["matmul_measured"] = {str(k): float(v) for k, v in dict(values.get("matmul_measured") or {}).items()}
        values["sources"] = tuple(str(s) for s in values.get("sources") or ())
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ConfigError(f"{where}: malformed hardware profile ({type(err).__name__}: {err}).") from None
    return Hardware(**values)


def named_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def load_profile(spec: str) -> Hardware:
    """A named profile (``a100_80gb_8x``) or a YAML file path."""
    import yaml

    path = Path(spec).expanduser()
    if not path.suffix and (PROFILES / f"{spec}.yaml").is_file():
        path = PROFILES / f"{spec}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"strategy.hardware={spec}: neither a named profile ({', '.join(named_profiles())}) nor a file. "
            "Give one of those names, or a profile written by `python -m parallelkit.plan --calibrate`."
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"strategy.hardware={spec}: not valid YAML ({err}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"strategy.hardware={spec}: a profile is a mapping of keys, got {type(data).__name__}.")
    return from_dict(data, f"strategy.hardware={spec}")


def save_profile(hardware: Hardware, path: Path, header: str = "") -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(hardware.as_dict(), sort_keys=False, width=120)
    path.write_text((header + "\n" if header else "") + text)
    return path


# ------------------------------------------------------------------------------------ strategy.hardware
#: The flat keys strategy.hardware has always taken, mapped onto a profile.
FLAT_KEYS = ("devices_per_node", "memory_per_device", "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency",
             "inter_node_latency", "flops_per_device", "memory_bandwidth", "memory_reserved")


def resolve_hardware(spec: Any, *, accelerator: str, devices_per_node: int, memory_default: float | None = None) -> Hardware:
    """``strategy.hardware`` → :class:`Hardware`: a profile name or path, or a mapping of the flat keys (null:
    the base profile's value) with an optional ``profile`` naming the base. Without a base: ``cpu_default`` or
    ``gpu_default`` (rough figures, not measurements), the node size from ``trainer.devices``."""
    values: dict[str, Any] = {}
    if isinstance(spec, str):
        base_name = spec
    else:
        values = {k: v for k, v in dict(spec or {}).items() if v is not None}
        base_name = values.pop("profile", None)
        unknown = sorted(set(values) - set(FLAT_KEYS))
        if unknown:
            raise ConfigError(f"strategy.hardware has no {unknown}; it takes profile (a name or a path) and {sorted(FLAT_KEYS)}.")
    explicit = base_name is not None
    base = load_profile(base_name or ("gpu_default" if accelerator == "gpu" else "cpu_default"))
    # The job's processes per node (trainer.devices) decide which ranks share a node, whatever node the profile
    # describes; only an explicit strategy.hardware.devices_per_node says otherwise.
    base = replace(base, devices_per_node=devices_per_node)
    if not explicit:
        base = replace(base, memory_per_device=memory_default or base.memory_per_device, memory_reserved=0.0)
    changes: dict[str, Any] = {}
    for key in ("devices_per_node",):
        if key in values:
            _positive(key, values[key], integer=True)
            changes[key] = values[key]
    for key in ("memory_per_device", "memory_bandwidth", "memory_reserved"):
        if key in values:
            (_non_negative if key == "memory_reserved" else _positive)(key, values[key])
            changes[key] = float(values[key])
    if "flops_per_device" in values:
        _positive("flops_per_device", values["flops_per_device"])
        changes["matmul_flops"] = {d: float(values["flops_per_device"]) for d in ("fp32", "bf16")}
    for side in ("intra_node", "inter_node"):
        link = getattr(base, side)
        bw, lat = values.get(f"{side}_bandwidth", link.bandwidth), values.get(f"{side}_latency", link.latency)
        _positive(f"{side}_bandwidth", bw)
        _non_negative(f"{side}_latency", lat)
        if (bw, lat) != (link.bandwidth, link.latency):
            changes[side] = Link(float(bw), float(lat))
            changes["collectives"] = {}  # measured fits no longer describe these links
    return replace(base, **changes) if changes else base


def host_memory_per_rank(devices_per_node: int) -> float:
    """This host's RAM shared by its ranks."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / devices_per_node
