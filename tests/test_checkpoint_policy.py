"""The interval policy: fixed steps or seconds, and `auto` from measured costs and the job's failures."""

from __future__ import annotations

import math

import pytest

from ettr.checkpoint.policy import (
    SECONDS_PER_DAY,
    IntervalConfig,
    IntervalPolicy,
    count_failures,
    failure_rate_per_day,
)
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.simulate import optimal_interval_s


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", IntervalConfig(auto=True)),
        ("500", IntervalConfig(every_steps=500)),
        ("20steps", IntervalConfig(every_steps=20)),
        ("90s", IntervalConfig(every_s=90.0)),
        ("15m", IntervalConfig(every_s=900.0)),
        ("1.5h", IntervalConfig(every_s=5400.0)),
    ],
)
def test_parse(text, expected):
    assert IntervalConfig.parse(text) == expected


def test_parse_passes_auto_options():
    assert IntervalConfig.parse("auto", failures_per_day=3.0).failures_per_day == 3.0


@pytest.mark.parametrize("text", ["", "often", "-5", "5 parsecs", "0.5"])
def test_parse_rejects_nonsense(text):
    with pytest.raises(ValueError, match="checkpoint interval"):
        IntervalConfig.parse(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"every_steps": 5, "auto": True},
        {"every_steps": 0},
        {"every_s": -1.0},
        {"every_s": math.inf},
        {"auto": True, "failures_per_day": 0.0},
        {"auto": True, "train_hours": 25.0},
        {"auto": True, "prior_days": 0.0},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        IntervalConfig(**kwargs)


def test_every_steps():
    policy = IntervalPolicy(IntervalConfig(every_steps=3), now_s=0.0)
    assert [s for s in range(1, 10) if policy.should_save(s, now_s=0.0)] == [3, 6, 9]


def test_every_seconds_counts_from_the_last_save():
    policy = IntervalPolicy(IntervalConfig(every_s=10.0), now_s=100.0)
    assert not policy.should_save(1, now_s=109.0)
    assert policy.should_save(2, now_s=110.0)
    policy.observe_save(cost_s=0.1, now_s=110.0)
    assert not policy.should_save(3, now_s=119.9)
    policy.reset(now_s=200.0)
    assert not policy.should_save(4, now_s=205.0)


def _failed_attempt(ts: float, outcome: Outcome) -> Event:
    return Event(EventKind.ATTEMPT_END, ts=ts, rank=SUPERVISOR_RANK, data={"outcome": str(outcome)})


def test_count_failures_reads_attempt_outcomes():
    events = [
        Event(EventKind.SUPERVISOR_START, ts=1000.0, rank=SUPERVISOR_RANK),
        _failed_attempt(1100.0, Outcome.FAILED),
        _failed_attempt(1200.0, Outcome.HUNG),
        _failed_attempt(1300.0, Outcome.PREEMPTED),
        _failed_attempt(1400.0, Outcome.COMPLETED),
        Event(EventKind.STEP, ts=1050.0, step=3),
    ]
    assert count_failures(events) == (3, 1000.0)
    assert count_failures([]) == (0, None)


def test_failure_rate_moves_from_the_prior_to_the_evidence():
    prior = failure_rate_per_day(prior_per_day=2.0, prior_days=1.0, num_failures=0, observed_s=0.0)
    assert prior == 2.0
    # ten failures in one day outweigh a prior of two a day worth one day
    assert (
        failure_rate_per_day(prior_per_day=2.0, prior_days=1.0, num_failures=10, observed_s=SECONDS_PER_DAY)
        == 6.0
    )
    # no failures for nine days: the estimate decays towards zero
    quiet = failure_rate_per_day(
        prior_per_day=2.0, prior_days=1.0, num_failures=0, observed_s=9 * SECONDS_PER_DAY
    )
    assert quiet == pytest.approx(0.2)


def test_auto_saves_at_once_to_measure_then_uses_the_optimum():
    config = IntervalConfig(auto=True, failures_per_day=4.0, prior_days=1.0)
    policy = IntervalPolicy(config, now_s=0.0)
    assert policy.interval_s(0.0) == 0.0
    assert policy.should_save(1, now_s=0.0)
    policy.observe_save(cost_s=0.5, now_s=1.0)
    expected = optimal_interval_s(save_cost_s=0.5, failures_per_day=policy.failures_per_day(1.0))
    assert policy.interval_s(1.0) == pytest.approx(expected)
    assert not policy.should_save(2, now_s=1.0 + expected - 1.0)
    # (the rate, and so the interval, drifts as the job ages: 1 % later is comfortably past it)
    assert policy.should_save(3, now_s=1.0 + expected * 1.01)


def test_auto_uses_the_median_of_recent_costs():
    policy = IntervalPolicy(IntervalConfig(auto=True, window=3), now_s=0.0)
    for cost in (100.0, 0.2, 0.3, 0.4):  # the first save's one-off cost falls out of the window
        policy.observe_save(cost_s=cost, now_s=0.0)
    expected = optimal_interval_s(save_cost_s=0.3, failures_per_day=policy.failures_per_day(0.0))
    assert policy.interval_s(0.0) == pytest.approx(expected)


def test_auto_is_never_shorter_than_a_persist():
    policy = IntervalPolicy(IntervalConfig(auto=True, failures_per_day=1e6), now_s=0.0)
    policy.observe_save(cost_s=0.001, now_s=0.0)
    assert policy.interval_s(0.0) < 5.0
    policy.observe_persist(120.0)
    assert policy.interval_s(0.0) == 120.0


def test_auto_interval_shrinks_with_the_job_failure_history():
    config = IntervalConfig(auto=True, failures_per_day=1.0, prior_days=1.0)
    calm = IntervalPolicy(config, now_s=0.0, num_failures=0, job_age_s=SECONDS_PER_DAY)
    rough = IntervalPolicy(config, now_s=0.0, num_failures=9, job_age_s=SECONDS_PER_DAY)
    for policy in (calm, rough):
        policy.observe_save(cost_s=1.0, now_s=0.0)
    assert rough.failures_per_day(0.0) == pytest.approx(5.0)
    assert calm.failures_per_day(0.0) == pytest.approx(0.5)
    assert rough.interval_s(0.0) < calm.interval_s(0.0)
    # re-evaluated as the job runs: a day later without new failures the rate is lower, the interval longer
    assert calm.interval_s(SECONDS_PER_DAY) > calm.interval_s(0.0)
