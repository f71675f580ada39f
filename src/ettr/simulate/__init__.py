"""`ettr simulate`: a discrete-event model of a job's life, fed by its own ledger and checked against
published results (docs/simulate.md).

params (JobParams), streams (seeded failure/preemption times), model (one run), summary (many runs),
analytic (the closed form; `optimal_interval_s` is `ettr.interval`'s, the one interval model), profile
(from a run directory), sweep (sweeps and policy comparison), fleet (preemption victims), render, command.
Only the light, pure `optimal_interval_s` is imported here; the rest (numpy) on use.
"""

from ettr.simulate.analytic import optimal_interval_s

__all__ = ["optimal_interval_s"]
