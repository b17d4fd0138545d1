"""The one exception type users see for bad input."""


class ConfigError(ValueError):
    """A setting that cannot work, raised before any process starts where possible.

    The message says which value is wrong, why, and what would work. ``train.py`` prints it as one
    paragraph and exits with code 2 instead of showing a traceback.
    """


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite (and no loss scaler is skipping such steps on purpose)."""


class WriteFailed(RuntimeError):
    """An output (a checkpoint) could not be written: a full disk, a read-only or vanished file system.

    The previous checkpoint is intact (writes are atomic). ``report``: whether this rank prints the message
    (the rank that hit the error, or rank 0 when every rank learned of another rank's failure).
    """

    def __init__(self, message: str, report: bool = True) -> None:
        super().__init__(message)
        self.report = report
