"""Lightning's CSV logger, but a run directory's ``metrics.csv`` is appended to, never deleted or truncated.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts ("Previous log files in this
directory will be deleted"), so a resumed run kept only the steps it trained itself; and when a run logs a
new column it rewrites the whole file in place, so a process killed during that rewrite lost the file. Here:

- an existing ``metrics.csv`` is kept: new rows are appended under its header (``parallelkit.run_dir`` has
  already moved the rows a resumed run will recompute into a side file, so no step appears twice);
- a new column rewrites the file with the union of the columns through a temporary file and a rename;
- a row left half-written by a killed process is closed with a line break, so the next row starts clean.

Example::

    Trainer(logger=CSVLogger("outputs/run", name="", version=""))   # conf/logger/csv.yaml
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from parallelkit.run_dir import write_atomically


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's experiment writer for a ``metrics.csv`` that may already hold rows (see the module docstring)."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, "rb+") as file:
                header = file.readline().decode().rstrip("\r\n")
                file.seek(0, os.SEEK_END)
                if file.tell() and (file.seek(-1, os.SEEK_END), file.read(1))[1] != b"\n":
                    file.write(b"\n")  # the end of a row a killed writer left unfinished
            self.metrics_keys = next(csv.reader([header])) if header else []

    @override
    def _check_log_dir_exists(self) -> None:
        """Lightning warns here and deletes ``metrics.csv``; its rows are this run directory's history."""

    @override
    def _record_new_keys(self) -> set[str]:
        # Lightning sorts the header again on every save; an existing file's column order must stay as it is
        # unless the file is rewritten anyway for a new column.
        new_keys = set().union(*self.metrics) - set(self.metrics_keys)
        if new_keys:
            self.metrics_keys = sorted(set(self.metrics_keys) | new_keys)
        return new_keys

    @override
    def save(self) -> None:
        if not self.metrics:
            return
        new_keys = self._record_new_keys()
        has_header = os.path.isfile(self.metrics_file_path) and os.path.getsize(self.metrics_file_path) > 0
        if new_keys and has_header:
            self._rewrite_with_new_header(self.metrics_keys)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        if not has_header:
            writer.writeheader()
        writer.writerows(self.metrics)
        with open(self.metrics_file_path, "a", newline="") as file:
            file.write(text.getvalue())
        self.metrics = []

    @override
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))

        def write(out: Any) -> None:
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, fieldnames=fieldnames, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            out.write(text.getvalue().encode())

        write_atomically(self.metrics_file_path, write)


class CSVLogger(LightningCSVLogger):
    """Lightning's ``CSVLogger`` whose ``metrics.csv`` keeps every earlier row (see the module docstring).

    Args:
        save_dir, name, version, prefix, flush_logs_every_n_steps: as Lightning's ``CSVLogger``. parallelkit
            passes the run directory as ``save_dir`` with ``name=""`` and ``version=""``, so the file is
            ``<run dir>/metrics.csv``.
    """

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
