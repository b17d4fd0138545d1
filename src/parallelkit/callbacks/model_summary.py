"""Lightning's model summary without its FLOPs column when nothing measured them.

Lightning counts FLOPs only for a module with an ``example_input_array``; every other run printed a ``FLOPs``
column of zeros and ``Total FLOPs: 0``, which reads as a measurement. A summary whose FLOPs were measured keeps
them. The table is Lightning's plain one, on stdout (also under the Rich progress bar: Rich's table always has
the column).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from typing_extensions import override


class MeasuredModelSummary(ModelSummary):
    """:class:`~lightning.pytorch.callbacks.ModelSummary`, with FLOPs shown only when they were measured.

    Args:
        max_depth: as Lightning's (1: the top-level modules).

    Example::

        Trainer(callbacks=[MeasuredModelSummary()])   # Params, Mode; no "Total FLOPs: 0"
    """

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int, **summarize_kwargs: Any) -> None:
        if total_flops:
            return ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                                          total_flops, **summarize_kwargs)
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns)
        # On stdout, where Lightning's Rich summary went (stderr holds the run's log lines); called on rank 0 only.
        print("\n".join(line for line in table.splitlines() if "flops" not in line.lower()), flush=True)
