"""The one exception type users see for bad input."""


class ConfigError(ValueError):
    """A setting that cannot work, raised before any process starts where possible.

    The message says which value is wrong, why, and what would work. ``train.py`` prints it as one
    paragraph and exits with code 2 instead of showing a traceback.
    """


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite (and no loss scaler is skipping such steps on purpose)."""
