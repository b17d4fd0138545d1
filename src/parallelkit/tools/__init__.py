"""The tools around training: ``plan`` before a run (the planner's ranking, the per-rank dry run), ``verify`` (a
configuration against one process), and after a run ``export`` (a ``save_pretrained`` directory), ``predict`` (what
``mode=predict`` runs) and ``pipeline_timeline`` (a traced pipeline schedule).

The commands are ``python -m parallelkit.tools.NAME``; ``plan``, ``verify`` and ``export`` keep their public
names, ``python -m parallelkit.NAME``, through one-line modules at the package root.
"""
