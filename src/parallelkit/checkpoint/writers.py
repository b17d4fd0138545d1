"""Write a canonical :class:`~parallelkit.checkpoint.sources.Checkpoint` tensor by tensor: at any moment this
process holds one tensor of the checkpoint (plus the small non-tensor state), never the model.

* :func:`write_file`: the one-file checkpoint ``strategy=single``/``ddp`` write (Lightning's dict, optimizer state
  in the index layout). The torch zip archive is written as ``torch.save`` writes it: the pickle first, with each
  tensor as a reference to a storage record, then one record per tensor, each read from the source just before.
* :func:`write_sharded`: a ``torch.distributed.checkpoint`` directory in the layout tp/ZeRO-3 write (optimizer state
  by parameter name, one ``param_groups`` list) that every mesh strategy (zero, tp, pp, hybrid4d) loads at any
  degree: DCP reads each rank's slice of a full tensor. Placeholders on the meta device make the save plan; the
  writer asks the planner for each tensor's data one at a time (DCP's serial CPU loader), and that is where it is read.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from parallelkit.checkpoint.sources import PARAM_ORDER_KEY, STATE_DICT, Checkpoint, LazyTensor
from parallelkit.distributed.checkpoint_io import META_FILE
from parallelkit.errors import ConfigError


def write_file(ckpt: Checkpoint, out: Path) -> Path:
    """``out``: one file that ``torch.load`` reads as the Lightning checkpoint of a one-process run."""
    unknown = [k for opt in ckpt.optimizers if not opt.get("order_known", True) for k in opt["keyed_groups"]]
    if unknown:
        raise ConfigError(f"{ckpt.path}: not yet convertible to one file: its ranks saved optimizer groups that hold several pipeline stages "
                          f"or experts each ({', '.join(unknown)}), and the model order of their parameters, which a one-file checkpoint "
                          "numbers them by, needs the model. Continue from the directory itself (ckpt_path=DIR works under every "
                          "strategy), or convert it to a sharded directory (strategy=tp/zero/pp).")
    order = {n: i for i, n in enumerate(ckpt.meta.get(PARAM_ORDER_KEY) or [])}

    def in_model_order(params: list[str]) -> list[str]:  # a group's names as the one-process model lists them
        return sorted(params, key=lambda n: order.get(n, len(order))) if order else list(params)

    names = [p for g in (ckpt.optimizers[0]["param_groups"] if ckpt.optimizers else []) for p in in_model_order(g["params"])]
    names += [n for n in ckpt.model if n not in names]
    index = {n: i for i, n in enumerate(names)}
    states = []
    for opt in ckpt.optimizers:
        groups = [{k: v for k, v in g.items()} | {"params": [index[p] for p in in_model_order(g["params"])]} for g in opt["param_groups"]]
        states.append({"state": {index[n]: dict(v) for n, v in opt["state"].items() if n in index}, "param_groups": groups})
    checkpoint = {**ckpt.meta, STATE_DICT: OrderedDict((n, ckpt.model[n]) for n in names if n in ckpt.model), "optimizer_states": states}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        _save_lazily(checkpoint, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


class _StorageRef:
    def __init__(self, key: str, tensor: LazyTensor) -> None:
        self.key, self.tensor = key, tensor


def _rebuild_args(ref: _StorageRef) -> tuple:
    shape = torch.Size(ref.tensor.shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return (ref, 0, shape, stride, False, OrderedDict())


def _save_lazily(obj: Any, path: Path) -> None:
    refs: list[_StorageRef] = []
    storage_names = torch.storage._dtype_to_storage_type_map()

    class Pickler(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, LazyTensor):
                ref = _StorageRef(str(len(refs)), value)
                refs.append(ref)
                return torch._utils._rebuild_tensor_v2, _rebuild_args(ref)
            if isinstance(value, torch.Tensor):  # a small tensor already in memory (e.g. from meta.pt)
                return self.reducer_override(LazyTensor(tuple(value.shape), value.dtype, lambda v=value: v))
            return NotImplemented

        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, _StorageRef):
                storage_type = getattr(torch, storage_names[value.tensor.dtype])
                return ("storage", storage_type, value.key, "cpu", int(torch.Size(value.tensor.shape).numel()))
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    data = buffer.getvalue()
    with torch.serialization._open_zipfile_writer(str(path)) as archive:
        archive.write_record("data.pkl", data, len(data))
        archive.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for ref in refs:  # one tensor in memory at a time
            tensor = ref.tensor.load().detach().cpu().contiguous()
            if tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()
            archive.write_record(f"data/{ref.key}", tensor.untyped_storage(), tensor.nbytes)
            del tensor


def write_sharded(ckpt: Checkpoint, out: Path) -> Path:
    """``out``: a sharded directory (``.metadata``, one ``.distcp`` file, ``meta.pt`` last) a mesh strategy loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    lazies: dict[str, LazyTensor] = {}

    def placeholder(key: str, value: Any) -> Any:
        if isinstance(value, LazyTensor):
            lazies[key] = value
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        return value

    state: dict[str, Any] = {STATE_DICT: {n: placeholder(f"{STATE_DICT}.{n}", t) for n, t in ckpt.model.items()}}
    for i, opt in enumerate(ckpt.optimizers):
        per_param = {n: {k: placeholder(f"optimizer_{i}.state.{n}.{k}", v) for k, v in entries.items()} for n, entries in opt["state"].items()}
        state[f"optimizer_{i}"] = {"state": per_param, "param_groups": opt["param_groups"]}

    # torch's FileSystemWriter keeps every tensor it wrote in a dict (for its safetensors format): the storage of
    # each is released when the next is asked for, after the writer has written it.
    written: list[torch.Tensor] = []

    class LazyPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            value = super().lookup_object(index)
            if not (isinstance(value, torch.Tensor) and value.is_meta):
                return value
            for done in written:
                done.untyped_storage().resize_(0)
            tensor = lazies[index.fqn].load().contiguous().clone()  # a storage of its own, that can be released
            written[:] = [tensor]
            return tensor

    out.mkdir(parents=True, exist_ok=False)
    writer = dcp.FileSystemWriter(str(out), thread_count=1, single_file_per_rank=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, storage_writer=writer, planner=LazyPlanner(), no_dist=True)
    meta = {k: v for k, v in ckpt.meta.items() if k != STATE_DICT}
    torch.save(meta, out / META_FILE)  # last: its presence marks the directory complete
    return out
