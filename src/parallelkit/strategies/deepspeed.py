"""DeepSpeed ZeRO (stages 0-3, host offload) inside Lightning's Trainer, on CPU/gloo as on GPU/NCCL.

Lightning's own ``DeepSpeedStrategy`` refuses the CPU; DeepSpeed itself does not. This strategy keeps
Lightning's loop, data, callbacks and logging, and lets the DeepSpeed engine own what it must own:

- the model and the torch optimizer from ``TrainModule.configure_optimizers`` go to ``deepspeed.initialize``
  (:func:`~parallelkit.distributed.deepspeed_engine.apply_deepspeed`); Lightning's LR scheduler keeps
  stepping the same ``param_groups`` the engine's optimizer reads its learning rate from;
- ``training_step`` runs through the engine's ``forward`` (Lightning's forward redirection), so stage 3's
  gather hooks fire; ``backward`` is ``engine.backward`` and the optimizer step is ``engine.step`` —
  Lightning's precision plugin, gradient clipping and ``.grad``-based callbacks are bypassed (capability
  ``LIGHTNING_BACKWARD`` is absent; DeepSpeed clips as ``trainer.gradient_clip_val`` says);
- gradient accumulation: Lightning divides each micro-batch loss by ``accumulate_grad_batches`` and calls
  the optimizer step once per window; the engine accumulates without dividing again and ``step()`` is
  the boundary (DeepSpeed's caller-managed accumulation);
- checkpoints are DeepSpeed checkpoint directories (``engine.save_checkpoint``, each rank writes its
  partitions) with Lightning's loop, callback and scheduler state inside; resume at the same world size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from parallelkit.capabilities import REPLICATED_PARAMS
from parallelkit.distributed.checkpoint_io import check_compatible, fqn_optimizer_states, load_unsharded
from parallelkit.distributed.comm_counting import uncounted
from parallelkit.distributed.deepspeed_checkpoint import deepspeed_layout, load_into_deepspeed_engine
from parallelkit.distributed.deepspeed_config import (
    auto_bucket_elements,
    build_deepspeed_config,
    validate_deepspeed_options,
    validate_trainer_settings,
)
from parallelkit.distributed.deepspeed_engine import counting_deepspeed
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S, init_process_group_for_attempt, process_group_timeout
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.strategies.base import ParallelKitStrategyMixin

CHECKPOINT_TAG = "checkpoint"  # the sub-directory DeepSpeed writes inside the checkpoint path
# Memory is measured on the first steps only (walking DeepSpeed's buffers costs milliseconds).
_MEASURED_STEPS = 2


class DeepSpeedStrategy(ParallelKitStrategyMixin, LightningDDPStrategy):
    """Train with a DeepSpeed engine: ZeRO stage 0-3 over all processes, optionally offloading to the host.

    Args:
        stage: ZeRO stage. 0: plain data parallel; 1: optimizer state sharded; 2: and gradients;
            3: and parameters.
        offload: ``none``; ``optimizer`` (stage >= 1): optimizer state and its step in host memory;
            ``params`` (stage 3): parameters too.
        bucket_elements: elements per gradient-reduce / parameter-gather bucket; ``None``: 1/8 of the
            model (DeepSpeed allocates buckets at full size; its own default is 200 MB of fp32).
        timeout_s: collective and rendezvous timeout in seconds.
        process_group_backend: ``gloo``/``nccl``; default from the device.

    Gradient clipping and accumulation come from the Trainer (``gradient_clip_val``,
    ``accumulate_grad_batches``); ``precision`` must be ``32-true``.

    Example::

        Trainer(strategy=DeepSpeedStrategy(stage=2, offload="optimizer"), devices=2, accelerator="cpu")
    """

    strategy_name = "deepspeed"

    def __init__(
        self,
        stage: int = 2,
        offload: str = "none",
        bucket_elements: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        timeout = process_group_timeout(timeout_s)
        validate_deepspeed_options(stage, offload, bucket_elements)
        super().__init__(timeout=timeout, process_group_backend=process_group_backend, start_method="popen")
        self._init_parallelkit()
        self.stage, self.offload, self.bucket_elements = stage, offload, bucket_elements
        self.timeout_s = float(timeout_s)
        # Replicated parameters up to stage 2; Lightning never runs backward (the engine does).
        self.capabilities = frozenset({REPLICATED_PARAMS}) if stage < 3 else frozenset()
        self.engine: Any = None
        self._state_peak = {"params": 0, "grads": 0, "optimizer": 0}
        self._state_where: dict[str, int] = {}
        self._steps = 0

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def default_devices(self, accelerator: str) -> int:
        return max(torch.cuda.device_count(), 1) if accelerator == "gpu" else 2

    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        # ZeRO shards over every process (DeepSpeed's data-parallel group is the whole world).
        return ParallelDims.from_degrees(world_size, dp=1, sharding=world_size) if self.stage else ParallelDims.from_degrees(world_size, dp=-1)

    @override
    def bind_trainer_config(self, trainer_cfg: Mapping[str, Any]) -> None:
        """Check, before any process starts, the Trainer settings DeepSpeed applies instead of Lightning."""
        validate_trainer_settings(
            trainer_cfg.get("precision", "32-true"), trainer_cfg.get("gradient_clip_val"), trainer_cfg.get("gradient_clip_algorithm")
        )

    # ---------------------------------------------------------------- Lightning hooks
    @override
    def setup_distributed(self) -> None:
        init_process_group_for_attempt(self._get_process_group_backend(), self._timeout, self)  # torchrun restarts; listeners on MASTER_ADDR
        super().setup_distributed()
        self._parallel_dims = self.plan(self.world_size)
        self.device_mesh = self._parallel_dims.build_mesh(self.root_device.type)

    @override
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        validate_trainer_settings(trainer.precision, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if trainer.state.fn != TrainerFn.FITTING:
            raise ConfigError(f"strategy=deepspeed trains (trainer.fit); {trainer.state.fn.value} is not supported.")
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError(f"strategy=deepspeed drives one optimizer; configure_optimizers returned {len(self.optimizers)}.")
        plan = getattr(getattr(trainer, "datamodule", None), "plan", None)
        config = build_deepspeed_config(
            self.stage,
            self.offload,
            # DeepSpeed uses batch sizes for its sample counters only; 1 when the data module has no plan.
            micro_batch_size=getattr(plan, "micro_batch_size", 1),
            accumulate=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            bucket_elements=self.bucket_elements or auto_bucket_elements(self.lightning_module),
        )
        from parallelkit.distributed.deepspeed_engine import apply_deepspeed

        self.engine = apply_deepspeed(self.lightning_module, self.optimizers[0], config)
        self.model = self.engine  # training_step runs through engine.forward (stage 3 gathers there)
        # Lightning's scheduler steps the param_groups the engine's optimizer reads its lr from.
        self.optimizers = [self.engine.optimizer]
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        base.register_step_pre_hook(lambda *_: self._measure_state())  # grads are flattened for the step here
        self.setup_precision_plugin()

    # The engine's collectives count as deepspeed_<collective> (stage 3 gathers in forward, validation's too).
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with counting_deepspeed(self.comm_stats):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with counting_deepspeed(self.comm_stats):
            return super().validation_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning has already divided the loss by accumulate_grad_batches: the engine must not again.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        with counting_deepspeed(self.comm_stats):
            self.engine.backward(closure_loss, scale_wrt_gas=False)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = closure()  # forward and engine.backward of the step's last micro-batch
        trainer = self.lightning_module.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._measure_state()
        with counting_deepspeed(self.comm_stats):
            self.engine.step()  # reduce (stage 0-1), clip, step, gather (stage 1-2), zero the gradients
        self._measure_state()
        self._steps += 1
        return result

    # ---------------------------------------------------------------- measurements
    def _measure_state(self) -> None:
        if self.engine is None or self._steps >= _MEASURED_STEPS:
            return
        from parallelkit.distributed.deepspeed_engine import deepspeed_state_bytes

        totals, where = deepspeed_state_bytes(self.engine)
        for key, value in totals.items():
            self._state_peak[key] = max(self._state_peak[key], value)
        for key, value in where.items():
            self._state_where[key] = max(self._state_where.get(key, 0), value)

    @override
    def model_state_bytes(self) -> dict[str, int]:
        """Per category, the most this rank held at the points measured (after backward, inside and after
        the optimizer step of the first steps, and now): DeepSpeed's flat buffers, fp32 master partitions,
        gradient partitions and communication buckets included."""
        self._measure_state()
        return dict(self._state_peak)

    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        lrs = [group["lr"] for group in self.engine.optimizer.param_groups] if self.engine is not None else []
        return {
            **super().summary_metrics(trainer),
            "deepspeed": {
                "stage": self.stage,
                "offload": self.offload,
                "lr": lrs,
                "state_bytes_by_buffer": dict(sorted(self._state_where.items())),
            }
        }

    # ---------------------------------------------------------------- checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (its partitions) must exist before its checkpoint can be loaded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its optimizer partitions; Lightning still restores the schedulers

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine saves the module, partitioned as it holds it

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # the engine saves the optimizer partitions

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise ConfigError("strategy=deepspeed writes DeepSpeed checkpoint directories; storage_options are not supported.")
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        def write(tmp: Path) -> None:
            with uncounted():
                self.engine.save_checkpoint(str(tmp), tag=CHECKPOINT_TAG, client_state=client_state, save_latest=False)

        self.save_directory_atomically(filepath, write)  # a full disk leaves the previous checkpoint whole

    @override
    def check_checkpoint(self, checkpoint_path: Any, expected_shapes: Mapping[str, Any] | None = None) -> None:
        """Before any process starts (``parallelkit.run``): a DeepSpeed checkpoint directory with its model states, or
        any other parallelkit checkpoint (a file or a sharded directory) of this model, continued into the engine."""
        path = Path(checkpoint_path)
        if not path.exists():
            raise ConfigError(
                f"ckpt_path={checkpoint_path} does not exist. Give a checkpoint directory (e.g. outputs/RUN/checkpoints/last.ckpt), or ckpt_path=last."
            )
        if (path / CHECKPOINT_TAG).is_dir():
            if not any((path / CHECKPOINT_TAG).glob("*model_states.pt")):
                raise ConfigError(
                    f"ckpt_path={checkpoint_path} is an incomplete DeepSpeed checkpoint (no model states): its writer died. Use an earlier checkpoint."
                )
            return
        if self.stage == 0:
            raise ConfigError(f"ckpt_path={checkpoint_path} was not written by strategy=deepspeed; a continuation into DeepSpeed from another "
                              "layout needs strategy.stage 1-3 (stage 0 keeps no partitions to write into; strategy=ddp continues it).")
        if expected_shapes is not None:
            check_compatible(path, dict(expected_shapes))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.check_checkpoint(checkpoint_path)
        path = Path(checkpoint_path)
        if not (path / CHECKPOINT_TAG).is_dir() or deepspeed_layout(path) != (self.stage, self.world_size):
            return self._load_other_layout(path)  # DeepSpeed's own loader needs the stage and rank count it saved with
        with uncounted():
            loaded, client_state = self.engine.load_checkpoint(
                str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if loaded is None or client_state is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint at {checkpoint_path}.")
        return client_state

    def _load_other_layout(self, path: Path) -> dict[str, Any]:
        """Another layout's checkpoint (another strategy's, or DeepSpeed's at another stage or rank count), read whole
        (parameters and optimizer state by name), each rank keeping its ZeRO partition
        (:func:`~parallelkit.distributed.deepspeed_checkpoint.load_into_deepspeed_engine`)."""
        checkpoint = load_unsharded(path)
        names = [name for name, _ in self.engine.module.named_parameters()]
        states = fqn_optimizer_states(checkpoint, names)
        if len(states) > 1:
            raise ConfigError(f"ckpt_path={path} holds {len(states)} optimizers; strategy=deepspeed trains with one.")
        load_into_deepspeed_engine(self.engine, checkpoint.pop("state_dict"), states[0]["state"] if states else {})
        self.engine.global_steps = int(checkpoint.get("global_step", 0))
        for key in [k for k in checkpoint if k.startswith("optimizer_")]:
            del checkpoint[key]
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Done by ``engine.load_checkpoint`` in :meth:`load_checkpoint`."""

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True) if Path(filepath).is_dir() else Path(filepath).unlink(missing_ok=True)
