"""How a global batch is cut into per-rank micro-batches, validated before any process starts."""

from __future__ import annotations

from dataclasses import dataclass

from parallelkit.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """The batch sizes of one optimizer step.

    ``global_batch_size = micro_batch_size × data_parallel_size × accumulate``: every data-parallel
    rank runs ``accumulate`` micro-batches of ``micro_batch_size`` samples per optimizer step.
    """

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    accumulate: int

    @classmethod
    def resolve(
        cls,
        *,
        global_batch_size: int | None,
        per_device_batch_size: int | None,
        data_parallel_size: int,
        accumulate: int = 1,
    ) -> BatchPlan:
        """Exactly one of ``global_batch_size`` (fixed across strategies) or ``per_device_batch_size``
        (fixed per data-parallel rank, so the global batch grows with the ranks) must be set."""
        if (global_batch_size is None) == (per_device_batch_size is None):
            raise ConfigError(
                "Set exactly one of data.global_batch_size (the global batch, held constant across strategies) "
                f"and data.per_device_batch_size (per data-parallel rank); got global_batch_size={global_batch_size}, "
                f"per_device_batch_size={per_device_batch_size}. To switch, pass e.g. "
                "`data.global_batch_size=null data.per_device_batch_size=8`."
            )
        _check_positive("trainer.accumulate_grad_batches", accumulate)
        _check_positive("the data-parallel size", data_parallel_size)
        if per_device_batch_size is not None:
            _check_positive("data.per_device_batch_size", per_device_batch_size)
            micro = per_device_batch_size
            return cls(micro * data_parallel_size * accumulate, micro, data_parallel_size, accumulate)
        _check_positive("data.global_batch_size", global_batch_size)
        per_step = data_parallel_size * accumulate
        if global_batch_size % per_step:
            lower = max(per_step, global_batch_size - global_batch_size % per_step)
            raise ConfigError(
                f"data.global_batch_size={global_batch_size} cannot be split evenly over {data_parallel_size} "
                f"data-parallel ranks × {accumulate} accumulation steps = {per_step} micro-batches. Use a multiple "
                f"of {per_step} (e.g. {lower} or {lower + per_step}), or change trainer.devices / "
                "trainer.accumulate_grad_batches."
            )
        return cls(global_batch_size, global_batch_size // per_step, data_parallel_size, accumulate)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} should be an int greater than 0. Got {value!r}.")
