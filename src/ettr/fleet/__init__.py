"""The fleet: many jobs' ETT, regressions per family, preemption cost, and live Prometheus metrics.

`load` reads run directories or a shared ledger into `JobSummary`s; `aggregate` (pure) makes the
`FleetReport`; `regress` (pure) finds regressions per family; `preempt` (pure) prices preempting each
running job; `json`, `text`, `html` render; `metrics` + `serve` expose Prometheus metrics; `command` is
the CLI of `ettr fleet` and `ettr serve`. See docs/fleet.md.
"""
