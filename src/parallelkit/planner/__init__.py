"""The automatic planner behind ``strategy=auto`` and ``python -m parallelkit.plan``: a cost model of a training
step (memory and time, term by term) over every layout ``strategy=hybrid4d`` can run, on a hardware profile.

- :mod:`~parallelkit.planner.workload` and :mod:`~parallelkit.planner.shapes`: what is trained, from the config alone;
- :mod:`~parallelkit.planner.hardware` (+ ``profiles/``) and :mod:`~parallelkit.planner.calibrate`: the machine;
- :mod:`~parallelkit.planner.layout`, :mod:`~parallelkit.planner.memory`, :mod:`~parallelkit.planner.cost_model`:
  a candidate and its estimates;
- :mod:`~parallelkit.planner.search`: the candidates and the choice; :mod:`~parallelkit.planner.report`: output;
- :mod:`~parallelkit.planner.validation`: the published large-scale runs it is checked against.

Nothing here imports torch: a plan of 16,384 ranks and a trillion parameters is arithmetic (docs/planner.md).
"""
