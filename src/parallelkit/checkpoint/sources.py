"""Open any parallelkit checkpoint as one canonical, *lazy* training state: nothing but shapes and dtypes is read
until a tensor is asked for, and then only that tensor.

* a one-process file (``strategy=single``, ``ddp``, ZeRO 1/2): a torch zip archive. Its pickle is read with
  placeholders for the storages (:class:`LazyTensor`); each storage is one record of the archive, read alone.
* a sharded ``torch.distributed.checkpoint`` directory (ZeRO 3, tp, pp, hybrid4d, cp): the ``.metadata`` file lists
  every tensor with its full shape and the chunks each rank wrote; one tensor is read by loading that key alone.

The canonical state is the FQN layout of :mod:`parallelkit.distributed.checkpoint_io`: ``model`` (name → tensor, in
optimizer-index order), ``optimizers`` (``{"state": {name: {key: tensor}}, "param_groups": [..names..]}``), and
``meta`` (everything else Lightning saved: loops, callbacks, schedulers, the data position...).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallelkit.distributed.checkpoint_io import (
    META_FILE,
    PARAM_GROUPS,
    merge_rank_keyed_groups,
)
from parallelkit.errors import ConfigError

STATE_DICT = "state_dict"
#: = :data:`parallelkit.models.module.PARAM_ORDER_KEY` (not imported: that module imports Lightning): the parameters'
#: names in the single-device model's order, which a one-file checkpoint numbers the optimizer state by.
PARAM_ORDER_KEY = "parallelkit_param_order"


@dataclass
class LazyTensor:
    """A tensor of a checkpoint that is read from disk only when :meth:`load` is called."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()

    def load(self) -> torch.Tensor:
        return self.read()


@dataclass
class Checkpoint:
    path: Path
    kind: str  # "file" | "dcp"
    model: dict[str, LazyTensor]
    optimizers: list[dict[str, Any]]
    meta: dict[str, Any]
    evidence: dict[str, Any] = field(default_factory=dict)  # what the layout was read from
    other_tensors: dict[str, LazyTensor] = field(default_factory=dict)  # outside the canonical state (DeepSpeed's partitions)

    def tensors(self) -> dict[str, LazyTensor]:
        """Every tensor, under the flat names a sharded directory uses (``state_dict.<name>``, ``optimizer_0.state...``)."""
        out = {f"{STATE_DICT}.{k}": v for k, v in self.model.items()}
        for i, opt in enumerate(self.optimizers):
            for name, entries in opt["state"].items():
                out.update({f"optimizer_{i}.state.{name}.{k}": v for k, v in entries.items() if isinstance(v, LazyTensor)})
        return {**out, **self.other_tensors}


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A :class:`Checkpoint` for a file or a sharded directory; :class:`ConfigError` naming the problem otherwise."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist. Give a checkpoint: a file or a directory such as outputs/RUN/checkpoints/last.ckpt.")
    if path.is_dir():
        if (path / META_FILE).is_file():
            return _open_dcp(path)
        if sorted(path.glob("*/*model_states.pt")):
            return _open_deepspeed(path)
        if (path / ".metadata").is_file() or list(path.glob("*.distcp")):
            raise ConfigError(
                f"{path} is an incomplete sharded checkpoint (no {META_FILE}, which is written last): its writer died. Use an earlier checkpoint."
            )
        raise ConfigError(f"{path} is a directory but not a checkpoint (no {META_FILE}, no .metadata). Give a checkpoint file or directory.")
    return _open_file(path)


# ------------------------------------------------------------------------------------ one file


_TRUSTED = (
    "torch",
    "numpy",
    "deepspeed",
    "lightning",
    "lightning_fabric",
    "parallelkit",
    "omegaconf",
    "collections",
    "typing",
    "pathlib",
    "_codecs",
    "datetime",
)
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "bytes", "range", "dict", "list", "tuple", "int", "float", "str", "bool", "object"}


def _enum_member(owner: Any, name: str) -> Any:
    """``getattr`` for the unpickler, limited to a member of an Enum class of a trusted package (such a class got
    here through ``find_class``): never a method or another attribute, which a crafted file could call."""
    import enum

    if isinstance(owner, enum.EnumMeta) and isinstance(name, str) and name in owner.__members__:
        return owner.__members__[name]
    raise pickle.UnpicklingError(f"the checkpoint holds getattr({owner!r}, {name!r}): only an Enum member is read this way")


class _LazyUnpickler(pickle.Unpickler):
    """Torch's checkpoint pickle with every storage replaced by a reference to its record; only types of the
    packages that write checkpoints here are rebuilt (no arbitrary code from a crafted file)."""

    def __init__(self, data: bytes, records: Any) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.records = records

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, requires_grad, hooks, *rest: data
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):  # a Parameter (DeepSpeed stage 3's flat groups)
            return lambda func, new_type, args, state: func(*args)
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member  # how some CPython releases pickle an Enum member: getattr(EnumClass, "NAME")
        if (module not in ("builtins", "__builtin__") and module.split(".")[0] not in _TRUSTED) or (
            module in ("builtins", "__builtin__") and name not in _BUILTINS
        ):
            raise pickle.UnpicklingError(f"the checkpoint holds a {module}.{name}, a type outside {_TRUSTED}")
        return super().find_class(module, name)

    def persistent_load(self, saved_id: Any) -> Any:
        _, storage_type, key, _location, numel = saved_id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "TypedStorage is deprecated": torch's own pickles name these classes
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return (key, dtype, numel)

    def _rebuild(self, storage: tuple, offset: int, size: tuple, stride: tuple, *_: Any) -> LazyTensor:
        key, dtype, numel = storage
        records = self.records

        def read() -> torch.Tensor:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            untyped = records.get_storage_from_record(f"data/{key}", nbytes, torch.UntypedStorage)._typed_storage()._untyped_storage
            return torch.empty(0, dtype=dtype).set_(untyped, offset, torch.Size(size), stride)

        return LazyTensor(tuple(size), dtype, read)


def _load_lazily(path: Path) -> Any:
    try:
        records = torch._C.PyTorchFileReader(str(path))
        return _LazyUnpickler(records.get_record("data.pkl"), records).load()
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user problem
        raise ConfigError(f"{path} is not a readable checkpoint file ({type(err).__name__}: {err}). Is it truncated, or not a torch checkpoint?") from None


def _open_file(path: Path) -> Checkpoint:
    checkpoint = _load_lazily(path)
    if not isinstance(checkpoint, dict) or STATE_DICT not in checkpoint:
        raise ConfigError(f"{path} holds no model weights (no state_dict): is it a parallelkit checkpoint?")
    model = dict(checkpoint.pop(STATE_DICT))
    names = list(model)
    optimizers = []
    for state in checkpoint.pop("optimizer_states", []):
        count = sum(len(g["params"]) for g in state["param_groups"])
        if count != len(names):
            raise ConfigError(f"{path}: its optimizer holds {count} parameters but its state_dict {len(names)} tensors (buffers or tied weights): "
                              "the parameter of each optimizer index cannot be told without the model. Not yet supported.")
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        optimizers.append({"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups})
    return Checkpoint(path, "file", model, optimizers, checkpoint, {"format": "one file (torch.save)"})


def _open_deepspeed(path: Path) -> Checkpoint:
    """DeepSpeed's ``<tag>/mp_rank_00_model_states.pt`` (module weights, Lightning's state) and one
    ``*optim_states.pt`` per data-parallel rank (its ZeRO partition: flat fp32 buffers and Adam's moments)."""
    tag = min(path.glob("*/*model_states.pt")).parent
    states = _load_lazily(min(tag.glob("*model_states.pt")))
    model = dict(states.pop("module", None) or {})
    others: dict[str, LazyTensor] = {}
    for file in sorted(tag.glob("*optim_states.pt")):
        _collect(_load_lazily(file).get("optimizer_state_dict", {}), f"{file.stem}.", others)
    config = states.get("ds_config") or {}
    evidence = {"format": f"DeepSpeed checkpoint directory (tag {tag.name}: module states + {len(list(tag.glob('*optim_states.pt')))} ZeRO partition files)",
                "zero_stage": (config.get("zero_optimization") or {}).get("stage"), "dp_world_size": states.get("dp_world_size"),
                "degrees": states.get("checkpoint_parallel_dimensions")}
    meta = {k: v for k, v in states.items() if k in ("epoch", "global_step", "loops", "callbacks", "lr_schedulers") or k[:1].isupper()}
    return Checkpoint(path, "deepspeed", model, [], meta, evidence, others)


def deepspeed_as_canonical(ckpt: Checkpoint) -> Checkpoint:
    """A DeepSpeed checkpoint's canonical state (parameters and Adam's state by name), for ``convert``. Read whole, not
    lazily: each ZeRO partition is one flat buffer holding a piece of every parameter, so peak memory is the training
    state (:func:`parallelkit.distributed.deepspeed_checkpoint.load_deepspeed_unsharded`)."""
    from parallelkit.distributed.deepspeed_checkpoint import load_deepspeed_unsharded

    def held(t: torch.Tensor) -> LazyTensor:
        return LazyTensor(tuple(t.shape), t.dtype, lambda: t)

    state = load_deepspeed_unsharded(ckpt.path)
    model = {n: held(t) for n, t in state.pop(STATE_DICT).items()}
    opt = state.pop("optimizer_0")
    optimizers = [{"state": {n: {k: held(v) if isinstance(v, torch.Tensor) else v for k, v in e.items()} for n, e in opt["state"].items()},
                   "param_groups": opt["param_groups"]}]
    return Checkpoint(ckpt.path, "deepspeed", model, optimizers, state, ckpt.evidence)


def _collect(value: Any, prefix: str, out: dict[str, LazyTensor]) -> None:
    if isinstance(value, LazyTensor):
        out[prefix.rstrip(".")] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect(v, f"{prefix}{k}.", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _collect(v, f"{prefix}{i}.", out)


# ------------------------------------------------------------------------------------ a sharded directory


def _open_dcp(path: Path) -> Checkpoint:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"{path} is not a readable sharded checkpoint ({type(err).__name__}: {err}).") from None
    entries = metadata.state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    others = [k for k in entries if k not in tensors]

    def lazy(key: str, md: Any) -> LazyTensor:
        return LazyTensor(tuple(md.size), md.properties.dtype, lambda: _read_one(path, key, md))

    prefix = STATE_DICT + "."
    model = {k[len(prefix):]: lazy(k, md) for k, md in tensors.items() if k.startswith(prefix)}
    small = _read_keys(path, set(others)) if others else {}
    optimizers = []
    for i in range(len({k.split(".")[0] for k in entries if k.startswith("optimizer_")})):
        opt_prefix = f"optimizer_{i}.state."
        state: dict[str, dict[str, Any]] = {}
        for key, md in tensors.items():
            if key.startswith(opt_prefix):
                name, entry = _split_state_key(key[len(opt_prefix):], model)
                state.setdefault(name, {})[entry] = lazy(key, md)
        loaded = small.get(f"optimizer_{i}", {})
        for name, entries_ in loaded.get("state", {}).items():  # non-tensor state entries (saved as bytes)
            state.setdefault(name, {}).update(entries_)
        groups_only = {k: v for k, v in loaded.items() if k.startswith(PARAM_GROUPS)}
        keyed = sorted((k for k in groups_only if k != PARAM_GROUPS), key=_stage_order)
        names = [p for k in ([PARAM_GROUPS] if PARAM_GROUPS in groups_only else keyed) for g in groups_only[k] for p in g["params"]]
        merged = merge_rank_keyed_groups(groups_only, list(dict.fromkeys(names)))
        # The parameters' model order (a one-file checkpoint numbers them in it) is known from one group list, or
        # from one pipeline stage per key in stage order; not where a key holds several stages (interleaved
        # schedules: rank 0 holds stages 0 and 2) or experts: there it needs the model, or the order the model
        # recorded in the checkpoint (PARAM_ORDER_KEY; checkpoints written since 2026-11-27).
        order_known = (PARAM_GROUPS in groups_only or PARAM_ORDER_KEY in meta
                       or all(_stage_order(k)[0] == 0 and len(_stage_order(k)) == 2 for k in keyed))
        optimizers.append({"state": state, "param_groups": merged[PARAM_GROUPS], "keyed_groups": keyed, "order_known": order_known})
    order = [p for opt in optimizers[:1] for g in opt["param_groups"] for p in g["params"]]
    model = {**{n: model[n] for n in order if n in model}, **model}  # optimizer-index order first: what a one-file checkpoint needs
    evidence = {"format": "sharded torch.distributed.checkpoint directory", "writer_ranks": len(list(path.glob("__*_*.distcp"))),
                "chunks": {k[len(prefix):]: [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] for k, md in tensors.items() if k.startswith(prefix)}}
    return Checkpoint(path, "dcp", model, optimizers, meta, evidence)


def _stage_order(key: str) -> tuple[int, ...]:
    """``param_groups_stages_3`` → (0, 3); anything else (several stages, experts) → (1, ...), sorted by name."""
    _, _, stages = key.partition("_stages_")
    if stages.isdigit():
        return (0, int(stages))
    return (1, *(int(p) for p in stages.split("_") if p.isdigit()))


def _split_state_key(rest: str, model: dict[str, Any]) -> tuple[str, str]:
    """``model.x.weight.exp_avg`` → (``model.x.weight``, ``exp_avg``): the longest parameter name that prefixes it."""
    name, _, entry = rest.rpartition(".")
    while name and name not in model:
        head, _, tail = name.rpartition(".")
        name, entry = head, f"{tail}.{entry}"
    return (name, entry) if name else tuple(rest.rsplit(".", 1))  # type: ignore[return-value]


def _read_one(path: Path, key: str, md: Any) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load({key: out}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


def _read_keys(path: Path, keys: set[str]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        return _load_state_dict_from_keys(keys=keys, checkpoint_id=str(path))
