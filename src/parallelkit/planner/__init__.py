"""The automatic planner behind ``strategy=auto`` and ``python -m parallelkit.plan``: a cost model of a training
step (memory and time, term by term) over every layout ``strategy=hybrid4d`` can run, on a hardware profile.

- :mod:`~parallelkit.planner.inputs`: the composed config, its data module and meta model;
- :mod:`~parallelkit.planner.workload` and :mod:`~parallelkit.planner.shapes`: what is trained, from the config alone;
- :mod:`~parallelkit.planner.hardware` (+ ``profiles/``) and :mod:`~parallelkit.planner.calibrate`: the machine;
- :mod:`~parallelkit.planner.layout`, :mod:`~parallelkit.planner.memory`, :mod:`~parallelkit.planner.cost_model`:
  a candidate and its estimates;
- :mod:`~parallelkit.planner.search`: the candidates and the choice; :mod:`~parallelkit.planner.report`: output;
  :mod:`~parallelkit.planner.auto`: ``strategy=auto``'s entry (a config in, a ranking out);
- :mod:`~parallelkit.planner.dry_run` and :mod:`~parallelkit.planner.plot`: one layout rank by rank (real model
  plans, fake process group) and its rank grid;
- :mod:`~parallelkit.planner.validation`: the published large-scale runs it is checked against.

No module here imports torch or matplotlib when imported: a plan of 16,384 ranks and a trillion parameters is
arithmetic (docs/planner.md); the dry run and the drawing import them when called. The command line is
:mod:`parallelkit.tools.plan`.
"""
