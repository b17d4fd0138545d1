"""``strategy=deepspeed`` with DeepSpeed's own ZeRO defaults instead of parallelkit's tuning (bench only).

``bench/zero_speed.py`` compares parallelkit's ZeRO against DeepSpeed *as a user would run it*: the ZeRO
section holds ``stage`` only and DeepSpeed 0.19.8 fills in the rest. parallelkit's
:func:`~parallelkit.distributed.deepspeed_config.build_deepspeed_config` sets these instead (its docstring
says why), and this strategy removes them again:

=====================================  ==============================  =================================
setting                                parallelkit (``strategy=deepspeed``)  DeepSpeed default (here)
=====================================  ==============================  =================================
``overlap_comm``                       false                           stage 3: true; stages 1-2: false
``reduce_bucket_size``                 1/8 of the model                5e8 elements
``allgather_bucket_size``              1/8 of the model                5e8 elements
``contiguous_gradients``               true                            true
``stage3_prefetch_bucket_size``        0                               5e7 elements
``stage3_param_persistence_threshold`` 0                               1e5 elements (kept gathered)
``stage3_max_reuse_distance``          0                               1e9
``stage3_max_live_parameters``         (default)                       1e9
``managed_gradient_accumulation``      false (Lightning accumulates)   true
=====================================  ==============================  =================================

Kept from parallelkit, because they decide *what* is trained, not how fast: the torch optimizer from
``conf/optim`` (``zero_allow_untested_optimizer``, ``zero_force_ds_cpu_optimizer: false``; DeepSpeed's own Adam
needs a compiled extension), ``gradient_clipping`` from ``trainer.gradient_clip_val`` (DeepSpeed's default
clips at 1.0; every other contender does not clip), the batch sizes, and quiet logging. DeepSpeed's own
accumulation needs ``trainer.accumulate_grad_batches=1`` (with 1, every ``backward`` is a boundary, and
``engine.step()`` steps as under parallelkit's setting).

    python train.py strategy=deepspeed strategy.stage=3 trainer.devices=2 \\
        strategy._target_=bench.deepspeed_defaults.DeepSpeedDefaultsStrategy
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from parallelkit.errors import ConfigError
from parallelkit.strategies.deepspeed import DeepSpeedStrategy

# What build_deepspeed_config writes on top of DeepSpeed's defaults for speed or memory (not for semantics).
PARALLELKIT_TUNING = (
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
)


def deepspeed_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (from ``build_deepspeed_config``) with parallelkit's tuning removed, so DeepSpeed's defaults apply."""
    if config["gradient_accumulation_steps"] != 1:
        raise ConfigError("DeepSpeedDefaultsStrategy lets DeepSpeed manage accumulation: use trainer.accumulate_grad_batches=1.")
    zero = {k: v for k, v in config["zero_optimization"].items() if k not in PARALLELKIT_TUNING}
    out = {k: v for k, v in config.items() if k != "managed_gradient_accumulation"}
    out["zero_optimization"] = zero
    return out


class DeepSpeedDefaultsStrategy(DeepSpeedStrategy):
    """parallelkit's DeepSpeed strategy, engine configured with DeepSpeed's defaults (see the module docstring).

    Args: as :class:`~parallelkit.strategies.deepspeed.DeepSpeedStrategy`; ``bucket_elements`` must stay unset.

    Example::

        Trainer(strategy=DeepSpeedDefaultsStrategy(stage=3), devices=2, accelerator="cpu")
    """

    def __init__(self, *args: Any, bucket_elements: int | None = None, **kwargs: Any) -> None:
        if bucket_elements is not None:
            raise ConfigError("DeepSpeedDefaultsStrategy uses DeepSpeed's default buckets; drop strategy.bucket_elements.")
        super().__init__(*args, **kwargs)

    @override
    def setup(self, trainer: Any) -> None:
        import parallelkit.strategies.deepspeed as module

        tuned = module.build_deepspeed_config
        module.build_deepspeed_config = lambda *a, **k: deepspeed_defaults(tuned(*a, **k))
        try:
            super().setup(trainer)
        finally:
            module.build_deepspeed_config = tuned
