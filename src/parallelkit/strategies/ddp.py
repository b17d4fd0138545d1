"""Data parallel training on any device type: Lightning's DDP with comm hooks that also run on CPU/gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from parallelkit.capabilities import DDP_COMM_HOOK, LIGHTNING_BACKWARD, MIXED_PRECISION, REPLICATED_PARAMS, SPARSE_GRADIENTS
from parallelkit.distributed.checkpoint_io import load_into_single_process
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S, init_process_group_for_attempt, process_group_timeout
from parallelkit.distributed.parallel_dims import DP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.strategies.base import ParallelKitStrategyMixin


class DDPStrategy(ParallelKitStrategyMixin, LightningDDPStrategy):
    """Replicate the model on every rank and average gradients over the data-parallel group.

    Differences from Lightning's ``DDPStrategy``: the comm hook is registered on every device type
    (Lightning's registers it on CUDA only), and by default it is parallelkit's counting all-reduce, so
    ``summary.json`` reports measured gradient traffic; processes are (re)launched per Hydra job, so
    ``-m`` sweeps work; and collectives time out after ``timeout_s`` (not 30 minutes) when a rank dies.

    Args:
        dp: data-parallel degree; ``-1`` = all processes (the only value that fits plain DDP).
        bucket_cap_mb: gradient bucket size in MiB (communication fusion).
        gradient_as_bucket_view: gradients alias the buckets (one copy less).
        static_graph: the autograd graph is the same every step.
        find_unused_parameters: allow parameters without gradients in a step.
        ddp_comm_hook: a DDP comm hook; default :func:`~parallelkit.distributed.comm_hooks.allreduce_hook`.
        ddp_comm_state: state for a third-party hook.
        timeout_s: collective and rendezvous timeout in seconds.
        process_group_backend: ``gloo``/``nccl``; default from the device.

    Example::

        Trainer(strategy=DDPStrategy(bucket_cap_mb=5), devices=2, accelerator="cpu")
    """

    strategy_name = "ddp"
    capabilities = frozenset({DDP_COMM_HOOK, REPLICATED_PARAMS, LIGHTNING_BACKWARD, MIXED_PRECISION})

    def __init__(
        self,
        dp: int = -1,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        timeout = process_group_timeout(timeout_s)
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ConfigError(f"strategy.bucket_cap_mb should be a number greater than 0. Got {bucket_cap_mb!r}.")
        super().__init__(
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            timeout=timeout,
            process_group_backend=process_group_backend,
            start_method="popen",
        )
        self._init_parallelkit()
        # Who chose the comm hook: the config (strategy.ddp_comm_hook), a callback (use_comm_hook), or nobody.
        self._comm_hook_owner: str | None = "strategy.ddp_comm_hook" if ddp_comm_hook is not None else None
        self.requested_dims = ParallelDims.request(dp=dp)  # data parallel only: dp = -1 or the whole world
        self.timeout_s = float(timeout_s)
        self._ddp_options = {
            "bucket_cap_mb": bucket_cap_mb,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }

    # ---------------------------------------------------------------- planning
    @override
    def default_devices(self, accelerator: str) -> int:
        if accelerator == "gpu":
            return max(torch.cuda.device_count(), 1)
        return 2

    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        return self.requested_dims.resolve(world_size)

    # ---------------------------------------------------------------- comm hooks chosen by callbacks
    @override
    def supports(self, capability: str) -> bool:
        if capability == SPARSE_GRADIENTS:  # DDP all-reduces sparse gradients itself; a comm hook gets dense buckets
            return self._comm_hook_owner is None
        return super().supports(capability)

    def reserve_comm_hook(self, owner: str) -> None:
        """Claim the (single) DDP comm hook for ``owner``; raises :class:`ConfigError` if someone else has it.

        Callbacks call this before any process starts (so a conflict costs one message, exit code 2), then
        :meth:`use_comm_hook` in their ``setup``.
        """
        if self._comm_hook_owner in (None, owner):
            self._comm_hook_owner = owner
            return
        if self._comm_hook_owner == "strategy.ddp_comm_hook":
            raise ConfigError(
                f"{owner} installs its own DDP comm hook, but the strategy's config already sets one "
                "(strategy.ddp_comm_hook, e.g. strategy=ddp_fp16); DDP runs exactly one hook per model. Use "
                "strategy=ddp without a hook (strategy.ddp_comm_hook=null), or drop the callback."
            )
        raise ConfigError(
            f"{owner} and {self._comm_hook_owner} both install a DDP comm hook, but DDP runs exactly one hook "
            "per model. Use one of these callbacks per run."
        )

    def use_comm_hook(self, hook: Callable, state: Any, owner: str) -> None:
        """Register ``hook`` with ``state`` at the DDP wrap (call from a callback's ``setup``).

        Callbacks' ``setup`` runs after the process group exists and before :meth:`setup` wraps the
        model, which is when DDP accepts a hook. A hook marked with
        :func:`~parallelkit.distributed.comm_hooks.counts_own_traffic` counts its own collectives.
        """
        if isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(
                f"{owner} asked for a DDP comm hook after the model was wrapped in DDP; install it from the "
                "callback's setup(), which Lightning runs before the strategy wraps the model."
            )
        self.reserve_comm_hook(owner)
        self._ddp_comm_hook = hook
        self._ddp_comm_state = state

    @property
    def data_parallel_group(self) -> Any:
        """The process group that DDP averages gradients over (after the process group is set up)."""
        return self.device_mesh.get_group(DP)

    # ---------------------------------------------------------------- Lightning hooks
    @override
    def setup_distributed(self) -> None:
        init_process_group_for_attempt(self._get_process_group_backend(), self._timeout, self)  # torchrun restarts; listeners on MASTER_ADDR
        super().setup_distributed()
        self._parallel_dims = self.plan(self.world_size)
        self.device_mesh = self._parallel_dims.build_mesh(self.root_device.type)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return apply_ddp(
            model,
            process_group=self.device_mesh.get_group(DP),
            device_ids=self.determine_ddp_device_ids(),
            comm_hook=self._ddp_comm_hook,
            comm_state=self._ddp_comm_state,
            comm_stats=self.comm_stats,
            **self._ddp_options,
        )

    @override
    def _register_ddp_hooks(self) -> None:
        """The hook is registered by :func:`apply_ddp`, on every device type."""

    @override
    def model_state_bytes(self) -> dict[str, int]:
        """Also DDP's gradient buckets: unless ``gradient_as_bucket_view``, its reducer keeps every gradient a
        second time in flat buckets (allocated when the model is wrapped) besides ``p.grad``."""
        state = super().model_state_bytes()
        state["grads"] += ddp_bucket_bytes(self.model)
        return state



    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Also continues from a sharded checkpoint directory (ZeRO-3, tensor or pipeline parallel, DeepSpeed, ...): every
        rank reads it whole, as one process does (:func:`~parallelkit.distributed.checkpoint_io.load_into_single_process`)."""
        if Path(checkpoint_path).is_dir():
            return load_into_single_process(checkpoint_path, self.lightning_module)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


def ddp_bucket_bytes(model: Any) -> int:
    """Bytes of the gradient buckets a :class:`DistributedDataParallel` module holds apart from ``p.grad`` (0 with
    ``gradient_as_bucket_view``, where the gradients are views into them): one slot for every trainable parameter."""
    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
