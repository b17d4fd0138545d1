"""parallelkit's CSV logger keeps an existing metrics.csv: rows are appended under its header, a new column
rewrites the file with the union of the columns (atomically), a row a killed writer left unfinished does not
swallow the next one. The control: Lightning's own CSVLogger, same calls, deletes the earlier rows."""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

from parallelkit.csv_logger import CSVLogger


def rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def first_run(cls, directory) -> None:
    logger = cls(directory, name="", version="")
    for step in range(3):
        logger.log_metrics({"train_loss": 3.0 - step}, step=step)
    logger.save()


def test_a_second_logger_appends_to_the_first_ones_rows(tmp_path):
    first_run(CSVLogger, tmp_path)
    second = CSVLogger(tmp_path, name="", version="")
    second.log_metrics({"train_loss": 0.5}, step=3)
    second.finalize("success")
    assert [(r["step"], r["train_loss"]) for r in rows(tmp_path / "metrics.csv")] == [("0", "3.0"), ("1", "2.0"), ("2", "1.0"), ("3", "0.5")]


def test_lightnings_logger_loses_the_first_rows(tmp_path):
    """The control: what the test above would see without parallelkit's logger."""
    first_run(LightningCSVLogger, tmp_path)
    second = LightningCSVLogger(tmp_path, name="", version="")
    second.log_metrics({"train_loss": 0.5}, step=3)
    second.finalize("success")
    assert [r["step"] for r in rows(tmp_path / "metrics.csv")] == ["3"]


def test_a_new_column_keeps_every_row_and_a_consistent_header(tmp_path):
    first_run(CSVLogger, tmp_path)
    second = CSVLogger(tmp_path, name="", version="")
    second.log_metrics({"train_loss": 0.5}, step=3)
    second.log_metrics({"val_loss": 0.7}, step=3)
    second.save()
    second.log_metrics({"train_loss": 0.4}, step=4)  # the file's header now has val_loss: later rows line up
    second.save()
    with open(tmp_path / "metrics.csv", newline="") as file:
        header = next(csv.reader(file))
    assert header == ["step", "train_loss", "val_loss"]
    got = [(r["step"], r["train_loss"], r["val_loss"]) for r in rows(tmp_path / "metrics.csv")]
    assert got == [("0", "3.0", ""), ("1", "2.0", ""), ("2", "1.0", ""), ("3", "0.5", ""), ("3", "", "0.7"), ("4", "0.4", "")]
    assert not list(tmp_path.glob(".metrics.csv.tmp*"))  # the rewrite went through a temporary file, renamed


def test_an_unsorted_existing_header_is_kept_as_it_is(tmp_path):
    (tmp_path / "metrics.csv").write_text("train_loss,step\r\n2.0,0\r\n")
    logger = CSVLogger(tmp_path, name="", version="")
    logger.log_metrics({"train_loss": 1.0}, step=1)
    logger.save()
    assert [(r["step"], r["train_loss"]) for r in rows(tmp_path / "metrics.csv")] == [("0", "2.0"), ("1", "1.0")]


def test_a_row_left_unfinished_does_not_swallow_the_next(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,train_loss\r\n0,3.0\r\n1,2.")  # the writer was killed mid-row
    logger = CSVLogger(tmp_path, name="", version="")
    logger.log_metrics({"train_loss": 1.0}, step=2)
    logger.save()
    assert [(r["step"], r["train_loss"]) for r in rows(tmp_path / "metrics.csv")] == [("0", "3.0"), ("1", "2."), ("2", "1.0")]
