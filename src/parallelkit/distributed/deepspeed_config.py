"""The DeepSpeed config dict for a parallelkit run, and the checks that must pass before any process starts.

Kept apart from :mod:`parallelkit.distributed.deepspeed_engine` so that validation does not import
DeepSpeed (seconds of start-up, and it prints accelerator warnings): ``plan()`` runs in the launching
process only.

Settings that differ from DeepSpeed's defaults, and why:

- ``gradient_clipping`` is always written (0 = off): DeepSpeed 0.19.8 otherwise clips at 1.0 while every
  other strategy clips as ``trainer.gradient_clip_val`` says (default: not at all).
- ``managed_gradient_accumulation: false``: Lightning decides when a micro-batch is the last of an
  optimizer step and calls ``step()`` once then; in this mode DeepSpeed's ``backward`` only accumulates
  and ``step()`` is the accumulation boundary. The loss arrives already divided by
  ``accumulate_grad_batches`` (Lightning does it), so the engine must not divide it again
  (``backward(..., scale_wrt_gas=False)``, see the strategy).
- ``zero_force_ds_cpu_optimizer: false`` / ``zero_allow_untested_optimizer: true``: the optimizer is the
  torch one from ``conf/optim`` (built by ``TrainModule.configure_optimizers``), also with offload — no
  DeepSpeed Adam, whose C++ extension would have to be compiled, and whose maths differ.
- ``stage3_param_persistence_threshold: 0``: DeepSpeed keeps every parameter under 100k elements
  gathered on every rank in stage 3; in a small model that is all of them, and stage 3 would shard
  nothing. ``stage3_max_reuse_distance: 0`` and ``stage3_prefetch_bucket_size: 0``: otherwise a
  parameter gathered (or prefetched) for forward stays gathered until backward uses it again — in a
  small model, all of them, every step. With both at 0 each layer is released after use and gathered
  again in backward, as in the ZeRO paper (stage 3 traffic 1.5× DDP's), at the cost of prefetch overlap.
- ``overlap_comm: false``: DeepSpeed allows overlap with caller-managed accumulation in stage 2 only;
  one setting for every stage keeps the stages comparable.
"""

from __future__ import annotations

from typing import Any

from parallelkit.errors import ConfigError

STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "optimizer", "params")
# Offload target → the lowest ZeRO stage DeepSpeed can honour it at.
_MIN_STAGE = {"optimizer": 1, "params": 3}
DEFAULT_BUCKET_ELEMENTS = 50_000_000  # DeepSpeed's default reduce/all-gather bucket (elements)
AUTO_BUCKET_FRACTION = 8  # auto buckets: 1/8 of the model


def auto_bucket_elements(model: Any) -> int:
    """A reduce/gather bucket sized to the model: 1/8 of its parameters, at least its largest tensor, at most
    DeepSpeed's default. DeepSpeed allocates its buckets at full size (stage 3 keeps one for the whole run):
    its default of 50M elements is 200 MB of fp32, far more than a small model's gradients."""
    sizes = [p.numel() for p in model.parameters()]
    return int(min(DEFAULT_BUCKET_ELEMENTS, max(max(sizes, default=1), sum(sizes) // AUTO_BUCKET_FRACTION)))


def validate_deepspeed_options(stage: Any, offload: Any, bucket_elements: Any = None) -> None:
    """Raise :class:`ConfigError` for a stage/offload combination DeepSpeed cannot run."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(f"strategy.stage should be one of 0, 1, 2, 3 for strategy=deepspeed (0 = plain data parallel). Got {stage!r}.")
    if offload not in OFFLOADS:
        raise ConfigError(f"strategy.offload should be one of {', '.join(OFFLOADS)}. Got {offload!r}.")
    if offload != "none" and stage < _MIN_STAGE[offload]:
        what = "optimizer state (ZeRO-Offload)" if offload == "optimizer" else "parameters (ZeRO-Infinity)"
        need = "strategy.stage=1, 2 or 3" if offload == "optimizer" else "strategy.stage=3"
        raise ConfigError(
            f"strategy.offload={offload} with strategy.stage={stage}: DeepSpeed offloads {what} only from "
            f"ZeRO stage {_MIN_STAGE[offload]} on. Use {need}, or strategy.offload=none."
        )
    if bucket_elements is not None and (isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int) or bucket_elements < 1):
        raise ConfigError(
            f"strategy.bucket_elements should be an int greater than 0 (elements per communication bucket) or null "
            f"(auto: sized to the model). Got {bucket_elements!r}."
        )


def validate_trainer_settings(precision: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any) -> None:
    """The Trainer settings that DeepSpeed (not Lightning) applies must be ones it can apply."""
    if str(precision) not in ("32-true", "32"):
        raise ConfigError(
            f"strategy=deepspeed runs fp32 (trainer.precision=32-true); got trainer.precision={precision}. "
            "DeepSpeed's own fp16/bf16 engines are not wired to Lightning's precision plugins here."
        )
    if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val < 0):
        raise ConfigError(f"trainer.gradient_clip_val should be a number >= 0 or null. Got {gradient_clip_val!r}.")
    if gradient_clip_val and gradient_clip_algorithm not in (None, "norm"):
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={gradient_clip_algorithm} with strategy=deepspeed: DeepSpeed clips by "
            "the global norm only. Use trainer.gradient_clip_algorithm=norm, or another strategy."
        )


def build_deepspeed_config(
    stage: int,
    offload: str = "none",
    *,
    micro_batch_size: int = 1,
    accumulate: int = 1,
    gradient_clip_val: float | None = None,
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
) -> dict[str, Any]:
    """The config dict for ``deepspeed.initialize`` (see the module docstring for each non-default).

    Args:
        stage: ZeRO stage 0-3 (0: data parallel, every rank keeps everything).
        offload: ``none``, ``optimizer`` (optimizer state and its step on the host) or ``params``
            (stage 3: parameters too).
        micro_batch_size: samples per rank per forward (DeepSpeed uses batch sizes for bookkeeping only).
        accumulate: micro-batches per optimizer step (``trainer.accumulate_grad_batches``).
        gradient_clip_val: clip the global gradient norm to this (``None``/0: no clipping).
        bucket_elements: elements per reduce / all-gather bucket.

    Example::

        build_deepspeed_config(2, "optimizer", micro_batch_size=4)["zero_optimization"]["offload_optimizer"]
        # {'device': 'cpu', 'pin_memory': False}
    """
    if bucket_elements is None:
        raise ValueError("build_deepspeed_config needs bucket_elements; auto_bucket_elements(model) sizes it to a model")
    validate_deepspeed_options(stage, offload, bucket_elements)
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(
            overlap_comm=False,
            contiguous_gradients=True,
            reduce_bucket_size=bucket_elements,
            allgather_bucket_size=bucket_elements,
        )
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    host = {"device": "cpu", "pin_memory": False}  # pinned pages only matter for a GPU's DMA
    if offload in ("optimizer", "params"):
        zero["offload_optimizer"] = dict(host)
    if offload == "params":
        zero["offload_param"] = dict(host)
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(accumulate),
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(gradient_clip_val or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # parallelkit reports progress itself
        "wall_clock_breakdown": False,
    }
