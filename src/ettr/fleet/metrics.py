"""The Prometheus metrics of a fleet: metric families built from `JobSummary`s at scrape time.

Names follow Prometheus conventions: base units (seconds, ratios 0..1), `_total` for counters (and the gauges below that were once counters), one
`ettr_` prefix; labels are only `job` and `job_id` (the same value: the job's id), `family`, `name` (the run
directory's name: what a person calls a job whose id was generated), `bucket`, `cause` and, fleet-wide only,
`detail` (bounded: closed sets, never step, rank or attempt), plus `version` on `ettr_build_info`.

`job_id` is there because Prometheus owns `job`: every scraped series gets the scrape config's `job_name`
as its `job` label, and under the default `honor_labels: false` the exposition's own `job` is renamed
`exported_job`. A query joining or grouping on `job` then sees one value for every ettr job (a real
Prometheus 2.42: `* on (job, family) group_left ettr_gpus` failed with "many-to-many matching not allowed"
as soon as a family had two jobs). `job_id` keeps its name under either setting; `job` stays for the
scrapers and queries that already read it. Each number is the same as in `ettr fleet --json`
(ETT% / 100 for the ratios).

A series is a counter only where it can never go down. The books are revised as a job goes on: a failure
moves the work since the last commit from `effective_training` to `wasted_progress`, a requeue turns the
preempted attempt's tail from `shutdown` into failure time, a running job's open tail (`other`) becomes
whatever its next event says; and a fleet-wide sum loses the jobs a scrape could not read (a ledger server
down). Prometheus takes any drop of a counter for a process restart and counts the whole new value as an
increase (`rate`, `increase`): a rolled-back minute of a ten-hour job read as ten hours of training in five
minutes. So the seconds per bucket and every fleet-wide sum are gauges (named as they always were, with
`_total`); the per-job failure and restart counts and the wall time grow as the job goes on and stay
counters.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import PurePath

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from ettr.accounting import Cause, Detail
from ettr.events import Bucket
from ettr.fleet.aggregate import totals
from ettr.fleet.model import JobSummary, version
from ettr.fleet.preempt import preemption_costs
from ettr.fleet.regress import find_regressions
from ettr.untrusted import printable

JOB_LABELS = ("job", "family", "name", "job_id")


def metric_families(jobs: Sequence[JobSummary], now: float, *, num_problems: int = 0) -> list[Metric]:
    """Every metric of the fleet of `jobs` at time `now`."""
    jobs = distinct_names(jobs)
    build = InfoMetricFamily("ettr_build", "ettr that serves these metrics")
    build.add_metric([], {"version": version()})
    fleet = totals(jobs)
    out: list[Metric] = [build]
    # No job read and some unreadable (the ledger server is down): the fleet's sizes and sums are unknown,
    # not 0 (a 0 would also read as a reset, and the next good scrape as every failure happening again).
    fleet_known = bool(jobs) or not num_problems

    def gauge(name: str, doc: str, labels: Sequence[str] = JOB_LABELS) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        out.append(g)
        return g

    def counter(name: str, doc: str, labels: Sequence[str] = JOB_LABELS) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(labels))
        out.append(c)
        return c

    fleet_ratio = gauge(
        "ettr_fleet_effective_training_ratio", "effective training / wall time, weighted by GPUs", ()
    )
    if fleet.ett_known:  # no sample when no job's ETT is known: 0 would be a wrong number
        fleet_ratio.add_metric([], fleet.ett_pct / 100.0)
    jobs_known = gauge("ettr_jobs", "jobs known", ())
    if fleet_known:
        jobs_known.add_metric([], float(len(jobs)))
    gauge("ettr_jobs_unreadable", "run directories or jobs that could not be read", ()).add_metric(
        [], float(num_problems)
    )
    fleet_buckets = gauge(
        "ettr_fleet_bucket_gpu_seconds_total",
        "wall time x GPUs of the jobs read in each bucket (a gauge: it drops when a job cannot be read, "
        "or when a failure turns kept work into wasted work)",
        ("bucket",),
    )
    fleet_failures = gauge(
        "ettr_fleet_failures_total",
        "failures of the jobs read by cause (a gauge: it drops when a job cannot be read)",
        ("cause",),
    )
    fleet_details = gauge(
        "ettr_fleet_failures_by_detail_total",
        "failures of the jobs read by what happened (oom_killed, collective, startup, ...; each detail has one "
        "cause; a gauge: it drops when a job cannot be read)",
        ("detail",),
    )
    if fleet_known:
        for b in Bucket:
            fleet_buckets.add_metric([b.value], fleet.bucket_gpu_s[b])
        for c in Cause:
            fleet_failures.add_metric([c.value], float(fleet.failures_by_cause[c]))
        for d in Detail:
            fleet_details.add_metric([d.value], float(fleet.failures_by_detail.get(d, 0)))
    ratio = gauge("ettr_effective_training_ratio", "effective training time / wall time of the job")
    window_ratio = gauge(
        "ettr_window_effective_training_ratio",
        "effective training / wall time over the job's last ettr_window_seconds (all of it when shorter)",
    )
    window_length = gauge("ettr_window_seconds", "the window of ettr_window_effective_training_ratio", ())
    straggler_wait = counter(
        "ettr_straggler_wait_seconds",
        "time the job waited for its slow ranks (jobs whose ranks were compared)",
    )
    stragglers = gauge("ettr_stragglers", "slow ranks or nodes found (jobs whose ranks were compared)")
    wall = counter("ettr_wall_seconds", "wall time of the job")
    bucket_s = gauge(
        "ettr_bucket_seconds_total",
        "wall time of the job in each bucket (a gauge: a failure turns kept work into wasted work, a requeue "
        "a preempted attempt's shutdown into failure time)",
        (*JOB_LABELS, "bucket"),
    )
    gpus = gauge("ettr_gpus", "GPUs (ranks, its world size) of the job")
    running = gauge("ettr_running", "1 while the job runs")
    tts = gauge("ettr_time_to_start_seconds", "allocation to the first training step")
    ttr = gauge("ettr_mean_time_to_recover_seconds", "mean of failure detected to training again")
    failures = counter("ettr_failures", "failures of the job by cause", (*JOB_LABELS, "cause"))
    restarts = counter(
        "ettr_restarts", "restarts of the job by the cause of the failure", (*JOB_LABELS, "cause")
    )
    unsaved = gauge(
        "ettr_unsaved_work_seconds", "training time since the last checkpoint commit (running jobs)"
    )
    since_commit = gauge(
        "ettr_time_since_last_commit_seconds", "time since the job's last checkpoint commit (running jobs)"
    )
    cost = gauge(
        "ettr_preemption_cost_gpu_seconds", "(unsaved work + recovery time) x GPUs, if preempted now"
    )
    for j in jobs:
        labels = _job_labels(j)
        if j.ett_known:  # no gauge for a job whose ETT is unknown (no training step seen)
            ratio.add_metric(labels, j.ett_pct / 100.0)
        if j.window_ett_pct is not None and j.ett_known:
            window_ratio.add_metric(labels, j.window_ett_pct / 100.0)
        if j.stragglers is not None:
            stragglers.add_metric(labels, float(len(j.stragglers)))
            straggler_wait.add_metric(labels, j.straggler_lost_s or 0.0)
        wall.add_metric(labels, _wall_so_far(j))
        for b in Bucket:
            bucket_s.add_metric([*labels, b.value], j.buckets_s[b])
        gpus.add_metric(labels, float(j.gpus))
        running.add_metric(labels, 1.0 if j.running else 0.0)
        if j.tts_s is not None:
            tts.add_metric(labels, j.tts_s)
        if j.mean_ttr_s is not None:
            ttr.add_metric(labels, j.mean_ttr_s)
        num_failures = dict.fromkeys(Cause, 0)
        num_restarts = dict.fromkeys(Cause, 0)
        for f in j.failures:
            num_failures[f.cause] += 1
            if j.last_attempt is not None and f.attempt < j.last_attempt:
                num_restarts[f.cause] += 1
        for c in Cause:
            failures.add_metric([*labels, c.value], float(num_failures[c]))
            restarts.add_metric([*labels, c.value], float(num_restarts[c]))
        if j.running and j.last_commit_ts is not None:
            since_commit.add_metric(labels, max(0.0, now - j.last_commit_ts))
    windows = {j.window_s for j in jobs}
    if len(windows) == 1:
        window_length.add_metric([], windows.pop())
    for price in preemption_costs(jobs, now):
        job_id = printable(price.job_id)
        price_labels = [job_id, printable(price.family), printable(price.name), job_id]
        unsaved.add_metric(price_labels, price.unsaved_s)
        cost.add_metric(price_labels, price.cost_gpu_s)
    per_family = dict.fromkeys(sorted({j.family for j in jobs}), 0)
    for r in find_regressions(jobs):
        per_family[r.family] += 1
    regressions = gauge(
        "ettr_regressions", "metrics of the family that regressed (ettr fleet --check)", ["family"]
    )
    for family, n in per_family.items():
        regressions.add_metric([printable(family)], float(n))
    return out


def distinct_names(jobs: Sequence[JobSummary]) -> list[JobSummary]:
    """`jobs`, each with a `name` that no other job of the same id and family has, so that no two jobs get
    one label set.

    Two run directories may hold jobs of one id and one directory name (`ettr run --job-id exp1` in
    `runs/teamA/exp1` and in `runs/teamB/exp1`; a copy of one run directory is dropped before, as the same
    job's books: `load.drop_copies`): the exposition then held every
    series twice, and Prometheus kept one of each pair and dropped the other without a word (a real
    Prometheus 2.42: the 2-GPU job with a failure was not there, its 8-GPU namesake was). Such jobs are named
    by the shortest tail of their run directories' paths that tells them apart (`teamA/exp1`), else numbered
    (`exp1 #2`) in their order; every other job keeps its name."""
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for i, j in enumerate(jobs):
        groups[(j.job_id, j.family, j.name)].append(i)
    names = [j.name for j in jobs]
    for members in groups.values():
        if len(members) < 2:
            continue
        parts = [PurePath(jobs[i].source).parts for i in members]
        for depth in range(2, max(len(p) for p in parts) + 1):
            tails = ["/".join(p[-depth:]) for p in parts]
            if len(set(tails)) == len(tails):
                for i, tail in zip(members, tails, strict=True):
                    names[i] = tail
                break
        taken = {(j.job_id, j.family, n) for j, n in zip(jobs, names, strict=True)}
        for number, i in enumerate(members[1:], start=2):
            if names[i] == jobs[i].name:  # no tail told them apart (one source read twice, ledger URLs)
                name = f"{jobs[i].name} #{number}"
                while (jobs[i].job_id, jobs[i].family, name) in taken:
                    name += "'"
                names[i] = name
                taken.add((jobs[i].job_id, jobs[i].family, name))
    return [j if n == j.name else replace(j, name=n) for j, n in zip(jobs, names, strict=True)]


def _job_labels(job: JobSummary) -> list[str]:
    """The job's label values, each character that is not printable written as its escape (a run directory
    named with an ESC: the exposition format escapes only backslash, quote and newline, and a terminal
    showing `curl /metrics` would run the sequence)."""
    job_id = printable(job.job_id)
    return [job_id, printable(job.family), printable(job.name), job_id]


def _wall_so_far(job: JobSummary) -> float:
    """The job's wall time as a counter may show it: a running job's report is closed at `now`, and its end,
    recorded a moment later (or found lost: closed at its last event), may come before a `now` already
    scraped; so a running job counts to its newest event, which its end is never before."""
    if job.running and job.last_event_ts is not None:
        return max(0.0, min(job.wall_s, job.last_event_ts - job.wall_start_ts))
    return job.wall_s


class FleetCollector(Collector):
    """Loads the fleet at each scrape (`load(now)` -> jobs, problems) and yields its metrics."""

    def __init__(
        self,
        load: Callable[[float], tuple[list[JobSummary], list[str]]],
        *,
        clock: Callable[[], float] = time.time,
        read_age_s: Callable[[], float] | None = None,
    ) -> None:
        self._load = load
        self._clock = clock
        self._read_age_s = read_age_s

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        jobs, problems = self._load(now)
        yield from metric_families(jobs, now, num_problems=len(problems))
        if self._read_age_s is not None:
            age = GaugeMetricFamily(
                "ettr_serve_read_age_seconds",
                "how old the read of the fleet this scrape serves is (0: read for it; a read slower than the "
                "scrape budget goes on in the background, and the newest complete one is served)",
            )
            age.add_metric([], self._read_age_s())
            yield age
