"""The batched engine (`ettr.simulate.batch`) gives the scalar loop's runs, run by run: the same buckets,
interruptions, TTS, TTRs and kept progress for every kind of job the model knows."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ettr.events import Bucket
from ettr.simulate.batch import simulate_batch
from ettr.simulate.model import _BUCKET_INDEX as BUCKET_INDEX
from ettr.simulate.model import simulate_seeded
from ettr.simulate.params import JobParams, RecoveryKind, Startup
from ettr.simulate.summary import BATCH_MIN_RUNS, simulate, summarize


def assert_same_runs(params: JobParams, *, runs: int, seed: int = 0) -> None:
    batch = simulate_batch(params, seed=seed, runs=runs)
    for i in range(runs):
        one = simulate_seeded(params, seed=seed, run_index=i)
        where = f"run {i} of {params}"
        assert batch.buckets_s[i] == pytest.approx(one.buckets_s, rel=1e-9, abs=1e-6), where
        assert batch.wall_s[i] == pytest.approx(one.wall_s, rel=1e-9), where
        assert batch.num_failures[i] == one.num_failures, where
        assert batch.num_preemptions[i] == one.num_preemptions, where
        if one.tts_s is None:
            assert math.isnan(batch.tts_s[i]), where
        else:
            assert batch.tts_s[i] == pytest.approx(one.tts_s, abs=1e-6), where
        assert batch.ttr_count[i] == len(one.ttr_s), where
        assert batch.ttr_sum_s[i] == pytest.approx(math.fsum(one.ttr_s), rel=1e-9, abs=1e-6), where
        assert batch.kept_s[i] == pytest.approx(one.kept_s, rel=1e-9, abs=1e-6), where


BASE = JobParams(
    gpus=64,
    failures_per_node_day=2.0,
    blocking_s=30.0,
    interval_s=600.0,
    restart_gap_s=300.0,
    detection_s=20.0,
    persist_s=100.0,
    first_startup=Startup(init_s=50.0, compile_s=30.0),
    restart_startup=Startup(init_s=20.0, restore_s=40.0),
    shutdown_s=60.0,
    scheduling_s=100.0,
    hardware_setup_s=30.0,
    duration_s=3 * 86_400.0,
)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"preemptions_per_day": 5.0},
        {"preemptions_per_day": 5.0, "handles_preemption": False, "preempt_requeue_s": 900.0},
        {"weibull_shape": 0.7},
        {"duration_s": None, "work_s": 2 * 86_400.0},
        {"duration_s": None, "work_s": 2 * 86_400.0, "interval_global": True, "preemptions_per_day": 3.0},
        {"failures_per_node_day": 20.0},  # failures in start-up and during restarts, often
        {"failures_per_node_day": 0.0},
        # evaluation in the loop (a profile's eval_s_per_train_s): the batch dropped it before
        {"eval_s_per_train_s": 0.4},
        {
            "eval_s_per_train_s": 0.4,
            "duration_s": None,
            "work_s": 2 * 86_400.0,
            "failures_per_node_day": 20.0,
        },
        {"scheduling_s": 4 * 86_400.0},  # the window closes before the job is allocated
        {"shutdown_s": 3 * 86_400.0 - 10.0},  # the window closes in start-up
        # recovery kinds: most failures restarted in place at 2 s, some warm, the rest at restart_s
        {
            "recovery_kinds": (
                RecoveryKind(name="in_place", cost_s=2.0, share=0.7),
                RecoveryKind(name="warm_restart", cost_s=60.0, share=0.2),
            )
        },  # fmt: skip
        {
            "recovery_kinds": (RecoveryKind(name="in_place", cost_s=0.0, share=1.0),),
            "preemptions_per_day": 5.0,
            "failures_per_node_day": 20.0,
        },  # fmt: skip
    ],
)
def test_the_batch_gives_the_scalar_loops_runs(changes: dict[str, object]) -> None:
    assert_same_runs(replace(BASE, **changes), runs=12)  # type: ignore[arg-type]


def test_a_large_job_at_llama3s_rate() -> None:
    params = JobParams(
        gpus=16_384,
        failures_per_node_day=466 / 54 / 2048,
        blocking_s=30.0,
        restart_gap_s=600.0,
        interval_s=750.0,
        duration_s=30 * 86_400.0,
    )
    assert_same_runs(params, runs=4, seed=7)


def test_a_job_that_outlives_its_first_block_of_failure_times() -> None:
    # A job of fixed work whose wall time exceeds the first block drawn (twice the work): more are drawn.
    params = JobParams(
        gpus=8,
        failures_per_node_day=30.0,
        blocking_s=200.0,
        interval_s=3000.0,
        restart_gap_s=1200.0,
        duration_s=None,
        work_s=86_400.0,
    )
    assert_same_runs(params, runs=6, seed=3)


_seconds = st.floats(min_value=0.0, max_value=5_000.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.integers(min_value=1, max_value=4096),
    per_node_day=st.sampled_from([0.0, 0.01, 0.3, 3.0]),
    shape=st.sampled_from([1.0, 1.0, 0.6, 1.8]),
    preempt=st.sampled_from([0.0, 0.0, 2.0, 20.0]),
    handles=st.booleans(),
    interval_s=st.floats(min_value=60.0, max_value=20_000.0),
    blocking_s=_seconds,
    persist_s=_seconds,
    detection_s=_seconds,
    gap_s=_seconds,
    startup=st.tuples(_seconds, _seconds, _seconds, _seconds),
    work=st.booleans(),
    interval_global=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_random_jobs_run_the_same_in_both_engines(
    gpus, per_node_day, shape, preempt, handles, interval_s, blocking_s, persist_s, detection_s, gap_s,
    startup, work, interval_global, seed,
) -> None:  # fmt: skip
    params = JobParams(
        gpus=gpus,
        failures_per_node_day=per_node_day,
        weibull_shape=shape,
        preemptions_per_day=preempt,
        handles_preemption=handles,
        interval_s=interval_s,
        interval_global=interval_global,
        blocking_s=blocking_s,
        persist_s=persist_s,
        detection_s=detection_s,
        restart_gap_s=gap_s,
        restart_startup=Startup(init_s=startup[0], compile_s=startup[1]),
        first_startup=Startup(restore_s=startup[2], data_wait_s=startup[3]),
        duration_s=None if work else 2 * 86_400.0,
        work_s=86_400.0 if work else None,
    )
    if params.failures_per_day * (interval_s + params.save_cost_s + params.restart_s) / 86_400 > 3:
        return  # a job that almost never keeps progress: the command refuses it (check_cost)
    assert_same_runs(params, runs=3, seed=seed)


def test_simulate_picks_an_engine_by_size_and_both_summarise_alike() -> None:
    runs = BATCH_MIN_RUNS + 3
    params = replace(BASE, preemptions_per_day=2.0)
    batched = simulate(params, runs=runs, seed=5)
    one_by_one = summarize(params, [simulate_seeded(params, seed=5, run_index=i) for i in range(runs)])
    assert batched.ett_pct == pytest.approx(one_by_one.ett_pct, rel=1e-12)
    assert batched.ett_pct_ci95 == pytest.approx(one_by_one.ett_pct_ci95, rel=1e-9)
    assert batched.buckets_s == pytest.approx(one_by_one.buckets_s, rel=1e-9)
    assert batched.num_failures_mean == one_by_one.num_failures_mean
    assert batched.mean_ttr_s == pytest.approx(one_by_one.mean_ttr_s, rel=1e-9)
    assert batched.tts_s_mean == pytest.approx(one_by_one.tts_s_mean, rel=1e-9)
    # and the first runs of a family are the same however many runs there are
    assert simulate(params, runs=2, seed=5).num_runs == 2
    assert np.isfinite(batched.ett_pct)


def test_recovery_kinds_cost_what_they_say_for_the_share_they_cover() -> None:
    """Restarting 80% of failures in place at 2 s instead of 360 s leaves the failures where they were (the
    same seeded times) and cuts the restart time by about that share; shares above 1 are refused."""
    plain = simulate_batch(BASE, seed=3, runs=200)
    kinds = (RecoveryKind(name="in_place", cost_s=2.0, share=0.8),)
    fast = simulate_batch(replace(BASE, recovery_kinds=kinds), seed=3, runs=200)
    restart = [BUCKET_INDEX[b] for b in (Bucket.RESTART, Bucket.RESTORE)]  # (init: the first start-up too)
    slow_s, fast_s = plain.buckets_s[:, restart].sum(), fast.buckets_s[:, restart].sum()
    assert 0.1 < fast_s / slow_s < 0.35  # ~20% of the failures still pay the full restart
    assert fast.num_failures.sum() == plain.num_failures.sum()  # (restarts never cut short by a failure here)
    everything = replace(BASE, recovery_kinds=(RecoveryKind(name="in_place", cost_s=20.0, share=1.0),))
    assert simulate_batch(everything, seed=3, runs=20).buckets_s[:, restart].sum() == pytest.approx(
        0.0, abs=1e-6
    )
    with pytest.raises(ValueError, match="more than 1"):
        replace(BASE, recovery_kinds=(RecoveryKind(name="in_place", cost_s=1.0, share=0.6),
                                      RecoveryKind(name="requeue", cost_s=1.0, share=0.6)))  # fmt: skip
    with pytest.raises(ValueError, match="recovery kind"):
        RecoveryKind(name="teleport", cost_s=1.0, share=0.1)
