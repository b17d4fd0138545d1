"""``mode=predict`` lives in :mod:`parallelkit.tools.predict`; these names stay importable from here for ``run.py``.

Not a command (``python train.py mode=predict ...`` runs it). Delete this module once ``run.py`` imports from
:mod:`parallelkit.tools.predict`.
"""

from parallelkit.tools.predict import check_predict_config, load_weights, predict

__all__ = ["check_predict_config", "load_weights", "predict"]
