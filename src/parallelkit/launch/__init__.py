"""How a job starts: the entry points' glue (:mod:`~parallelkit.launch.cli`), the local ranks
(:mod:`~parallelkit.launch.local_ranks`) and the paused collector of start-up (:mod:`~parallelkit.launch.startup_gc`).

Imported by ``train.py`` before Hydra and torch, so this package imports nothing heavy at module level.
"""
