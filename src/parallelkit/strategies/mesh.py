"""The common base of strategies that parallelize the model in place on a named device mesh.

ZeRO/FSDP sharding, tensor parallel, expert parallel and their hybrid all work the same way inside
Lightning: initialise the process group, build the 4-axis mesh from :class:`ParallelDims`, apply the
techniques to the model (``parallelize``), then create the optimizer, and save/load checkpoints with
``torch.distributed.checkpoint`` so a run saved at N ranks loads at M. Subclasses only say which degrees
they take and which ``apply_*`` functions they compose, in :meth:`MeshStrategy.parallelize`.

Built on Lightning's ``ModelParallelStrategy`` (its checkpoint and collective plumbing) but without its
requirement that the LightningModule parallelize itself in ``configure_model``: in parallelkit the plan is
chosen on the command line and applied by the strategy, to the module :func:`~parallelkit.models.plans.parallel_model`
names (the model parallelkit's ``TrainModule`` wraps, or any other LightningModule as a whole). A
LightningModule sharded as a whole runs its steps through its own ``__call__`` (Lightning's forward
redirection), so that the hooks FSDP2 puts around a root module's forward also fire around ``training_step``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD
from parallelkit.distributed.deepspeed_checkpoint import is_deepspeed_checkpoint
from parallelkit.distributed.dtensor_step import use_foreach_for_dtensors
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S, init_process_group_for_attempt, process_group_timeout
from parallelkit.distributed.grad_sync import GradAllReduce
from parallelkit.distributed.parallel_dims import ParallelDims, add_lightning_axis_names
from parallelkit.errors import ConfigError
from parallelkit.models.plans import parallel_model
from parallelkit.strategies.base import ParallelKitStrategyMixin


class MeshStrategy(ParallelKitStrategyMixin, ModelParallelStrategy):
    """Parallelize the LightningModule's model in place on the mesh, then train with Lightning's loop.

    Args:
        dims: the requested degrees (:meth:`ParallelDims.request`; ``-1``: the remaining ranks), resolved and
            validated for the world size before any process starts; its ``mesh_order`` is the mesh's axes,
            outermost first (default ``pp, dp, sharding, tp``).
        save_distributed_checkpoint: each rank writes its shard (a checkpoint directory) rather than
            gathering a single file on rank 0.
        timeout_s: collective and rendezvous timeout in seconds.
        process_group_backend: ``gloo``/``nccl``; default from the device.

    Subclasses override :meth:`parallelize` and may append to ``self.grad_syncs`` the gradient
    averaging that must run after the last backward of each optimizer step.
    """

    strategy_name = "mesh"
    capabilities = frozenset({LIGHTNING_BACKWARD})

    def __init__(
        self,
        dims: ParallelDims | None = None,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        timeout = process_group_timeout(timeout_s)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_parallelkit()
        self.requested_dims = dims if dims is not None else ParallelDims.request()
        self.timeout_s = float(timeout_s)
        self.grad_syncs: list[GradAllReduce] = []
        self._steps_through_call = False

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def default_devices(self, accelerator: str) -> int:
        if accelerator == "gpu":
            return max(torch.cuda.device_count(), 1)
        return 2

    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        return self.requested_dims.resolve(world_size)

    # ---------------------------------------------------------------- Lightning hooks
    @override
    def setup_environment(self) -> None:
        # Lightning's version builds a 2-D (data, tensor) mesh; parallelkit's mesh has every axis.
        super(ModelParallelStrategy, self).setup_environment()
        init_process_group_for_attempt(self._get_process_group_backend(), self._timeout, self)  # torchrun restarts; listeners on MASTER_ADDR
        self._setup_distributed()
        self._parallel_dims = self.plan(self.world_size)
        self._device_mesh = self._parallel_dims.build_mesh(self.root_device.type)
        add_lightning_axis_names(self._device_mesh)  # configure_model code written for Lightning's strategy
        self.device_mesh = self._device_mesh
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def device_mesh(self) -> Any:
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh

    @override
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        self.check_lightning_module(self.lightning_module)
        model = parallel_model(self.lightning_module)
        model.to(self.root_device)
        # The whole model's parameter names, in order, before a split drops some: a one-file checkpoint's optimizer
        # state is keyed by their index.
        self.full_param_names = [name for name, _ in self.lightning_module.named_parameters()]
        self.parallelize(model)
        # FSDP2's root hooks gather and reshard around the root's __call__; Lightning calls training_step directly.
        self._steps_through_call = isinstance(self.lightning_module, FSDPModule)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.shard_optimizers()
            self.check_optimizers()
            use_foreach_for_dtensors(self.optimizers)  # sharded/TP parameters: one DTensor dispatch per op, not per tensor
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, model: torch.nn.Module) -> None:
        """Apply this strategy's techniques to ``model`` in place (the subclass's composition)."""
        raise NotImplementedError

    def check_optimizers(self) -> None:
        """The gradient averaging of ``grad_syncs`` runs once per optimizer step; with several optimizers
        (Lightning's manual optimization) it would run once per optimizer and each step would average the
        gradients again."""
        if len(self.optimizers) > 1 and self.grad_syncs:
            raise ConfigError(
                f"strategy={self.strategy_name} averages the gradients of the whole model at each optimizer step, but "
                f"{type(self.lightning_module).__name__}.configure_optimizers returned {len(self.optimizers)} optimizers: each "
                "step would average them again. Use one optimizer (several parameter groups work), or strategy=ddp, or "
                "strategy=zero with strategy.stage=3."
            )

    # ---------------------------------------------------------------- steps of a module sharded as a whole
    def _step(self, method: str, context: str, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's step, or, for a module sharded as a whole, the same step through the module's ``__call__``."""
        if not self._steps_through_call:
            return lightning_step(*args, **kwargs)
        with getattr(self.precision_plugin, context)():
            return self._forward_redirection(self.lightning_module, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", "train_step_context", super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", "val_step_context", super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", "test_step_context", super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", "predict_step_context", super().predict_step, *args, **kwargs)

    def shard_optimizers(self) -> None:
        """Called once the optimizers exist (ZeRO stages 1-2 shard their state here); default: nothing."""

    def after_optimizer_step(self) -> None:
        """Called after every optimizer step (ZeRO stages 1-2 all-gather the updated parameters here)."""

    def after_grad_sync(self) -> None:
        """Called once the gradients are averaged, before clipping (pipeline: clip by the norm over all stages)."""

    # ---------------------------------------------------------------- atomic sharded checkpoints
    #: its ``save_checkpoint`` writes Lightning's ModelParallelStrategy layouts (one file, or tensors through DCP +
    #: ``meta.pt``), which ``checkpoint.async_save`` reproduces (:func:`parallelkit.distributed.async_checkpoint.checkpoint_layout`).
    writes_model_parallel_layout = True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint directory: every rank writes its shard, rank 0 ``meta.pt`` last (the completion
        marker loaders look for), all under a temporary name swapped in whole (:meth:`save_directory_atomically`)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.save_directory_atomically(filepath, lambda tmp: super(MeshStrategy, self).save_checkpoint(checkpoint, tmp, storage_options))

    def param_groups_key(self) -> str:
        """The checkpoint key of this rank's optimizer ``param_groups``.

        A checkpoint keeps one object per key (rank 0's), which is right while every rank's groups list the
        same parameters. Where ranks hold different ones (pipeline stages, experts), a strategy names the
        groups after what this rank holds, so each rank saves and finds its own.
        """
        return "param_groups"

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._rank_keyed(super().optimizer_state(optimizer))

    def _rank_keyed(self, state: dict[str, Any], back: bool = False) -> dict[str, Any]:
        key = self.param_groups_key()
        old, new = (key, "param_groups") if back else ("param_groups", key)
        return {(new if k == old else k): v for k, v in state.items()}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank loads its parameters and optimizer state from the distributed checkpoint.

        Lightning's loader only accepts models with DTensor parameters. A pipeline stage's or an expert
        shard's are plain tensors under the full model's names (``model.layers.3...``, ``...experts.5...``),
        so a rank reads exactly the ones it holds.
        """
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()) and self._saved_with_global_groups(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Plain tensors (a stage's, an expert shard's), or a checkpoint whose ranks keyed their optimizer groups (a pipeline's):
        # each rank reads, by name, exactly what it holds (DTensors resharded by torch.distributed.checkpoint).
        return self._load_per_rank_checkpoint(checkpoint_path, weights_only)

    def _saved_with_global_groups(self, checkpoint_path: Any) -> bool:
        """The checkpoint holds one ``param_groups`` for every rank (not per pipeline stage / expert shard)."""
        from torch.distributed.checkpoint import FileSystemReader

        path = Path(self.broadcast(str(checkpoint_path)))
        if is_deepspeed_checkpoint(path):
            return False  # read whole by every rank (_load_whole)
        if not (path / "meta.pt").is_file():
            return True  # not a directory: Lightning's loader says what it is
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return any(k.startswith("optimizer_0.param_groups.") for k in saved) or not any(k.startswith("optimizer_") for k in saved)

    def _load_per_rank_checkpoint(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_file() or is_deepspeed_checkpoint(path):
            return self._load_whole(path)
        if not (path / "meta.pt").is_file():
            raise ConfigError(f"strategy={self.strategy_name} resumes from a distributed checkpoint directory (with meta.pt) or a "
                              f"checkpoint file; {path} is neither.")
        from torch.distributed.checkpoint import FileSystemReader

        module = self.model
        state = {"state_dict": get_model_state_dict(module)}
        dcp.load(state, checkpoint_id=path)
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            current = self._rank_keyed(get_optimizer_state_dict(module, optimizer))
            if any(k.startswith(f"{key}.{self.param_groups_key()}.") for k in saved):
                optim_state = {key: current}
                dcp.load(optim_state, checkpoint_id=path)
                loaded = self._rank_keyed(optim_state[key], back=True)
            else:
                # Written by another layout (its groups under another key: tensor parallel's one "param_groups", other
                # pipeline stages'): the per-parameter state (moments, steps) by name, this rank's own groups (their
                # learning rate is the restored schedule's; the rest is the configuration's, as when it was saved).
                optim_state = {key: {"state": current["state"]}}
                dcp.load(optim_state, checkpoint_id=path)
                loaded = {"state": optim_state[key]["state"], "param_groups": self._rank_keyed(current, back=True)["param_groups"]}
            set_optimizer_state_dict(module, optimizer, optim_state_dict=loaded, options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=weights_only)

    def _load_whole(self, path: Path) -> dict[str, Any]:
        """A one-file checkpoint (``strategy=single`` or ``ddp``) or a DeepSpeed directory: every rank reads it whole and
        keeps, by name, the parameters (plain or DTensor: sliced to its shard) and per-parameter optimizer state it holds;
        the optimizer groups are this rank's (their learning rate is the restored schedule's). An index-keyed optimizer
        state is named with the whole model's parameter names, taken before the model was split (:attr:`full_param_names`)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from parallelkit.distributed.checkpoint_io import fqn_optimizer_states, load_unsharded

        checkpoint = load_unsharded(path)
        module = self.model
        saved = checkpoint.pop("state_dict")
        own = get_model_state_dict(module)
        missing = sorted(set(own) - set(saved))
        if missing:
            raise ConfigError(f"ckpt_path={path} lacks parameters this model holds: {missing[:4]}. Use the model settings it was trained with.")
        whole = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(module, {name: saved[name] for name in own}, options=whole)
        states = fqn_optimizer_states(checkpoint, self.full_param_names)
        for optimizer, state in zip(self.optimizers, states):
            named = state["state"]
            current = get_optimizer_state_dict(module, optimizer)  # this rank's names and groups (nothing gathered)
            loaded = {"state": {name: named[name] for name in current["state"] if name in named}, "param_groups": current["param_groups"]}
            set_optimizer_state_dict(module, optimizer, optim_state_dict=loaded, options=whole)
        for key in [k for k in checkpoint if k.startswith("optimizer_")]:
            del checkpoint[key]
        return checkpoint

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Lightning runs forward and backward inside ``closure``; averaging the gradients right after it
        # puts the sync before gradient clipping and ``on_before_optimizer_step`` callbacks.
        def closure_then_sync() -> Any:
            result = closure()
            for sync in self.grad_syncs:
                sync.sync()
            self.after_grad_sync()
            return result

        result = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self.after_optimizer_step()
        return result
