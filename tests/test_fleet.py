"""ettr fleet: failure causes, families, regressions (stable families stay quiet), preemption order, and
the CLI over synthetic run directories written through the ledger API."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ettr.accounting import Cause, compute
from ettr.cli import main
from ettr.events import Bucket
from ettr.fleet.aggregate import build_fleet, quantile
from ettr.fleet.model import JobSummary
from ettr.fleet.preempt import choose_victims, preemption_costs
from ettr.fleet.regress import RegressionConfig, find_regressions
from ettr.testing.fleet import JobSpec, job_events, write_job

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """`ettr fleet` caches summaries under $XDG_CACHE_HOME: keep each test's to itself."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _report(spec: JobSpec):
    events = job_events(spec)
    return compute(events, max(e.ts for e in events), job_id=spec.job_id)


# -- failure causes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "cause"),
    [("user", Cause.USER), ("infra", Cause.INFRA), ("preemption", Cause.PREEMPTION), ("hang", Cause.HANG)],
)
def test_each_failure_gets_its_cause_evidence_and_ttr(kind, cause):
    report = _report(JobSpec(job_id="j", fail_at_steps=(30, 60), failure_kind=kind))
    assert report.num_failures == 2
    assert [f.cause for f in report.failures] == [cause, cause]
    assert all(f.evidence for f in report.failures)
    assert [f.ttr_s for f in report.failures] == pytest.approx(list(report.ttr_s))
    assert report.num_infra_failures == (2 if cause is Cause.INFRA else 0)


def test_causes_from_the_supervisors_classification():
    from ettr.accounting.causes import classify_failure
    from ettr.accounting.model import AttemptReport
    from ettr.events import Outcome

    def attempt(outcome=Outcome.FAILED, closed=False, **failure):
        return AttemptReport(index=0, start_ts=0, end_ts=1, outcome=outcome, exit_code=failure.pop("code", 1),
                             resumed_from_step=None, last_step=None, lost_steps=0, buckets_s={},
                             training_start_ts=None, num_steps=0, reference_rank=None,
                             closed_by_accounting=closed, failure=failure, phases_s={})  # fmt: skip

    assert classify_failure(attempt(signal="SIGKILL", oom=True))[0] is Cause.INFRA
    assert "OOM" in classify_failure(attempt(signal="SIGKILL", oom=True))[1]
    assert classify_failure(attempt(exception="OutOfMemoryError", oom=True))[0] is Cause.USER  # CUDA OOM
    assert classify_failure(attempt(exception="DistBackendError"))[0] is Cause.INFRA
    tail = ["[E] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)", "RuntimeError: x"]
    assert classify_failure(attempt(exception="RuntimeError", stderr_tail=tail))[0] is Cause.INFRA
    assert (
        classify_failure(attempt(exception="ValueError", reason="exit status 1: ValueError"))[0] is Cause.USER
    )
    assert classify_failure(attempt(process_failure={"exception": "KeyError"}))[0] is Cause.USER
    assert classify_failure(attempt(signal="SIGBUS"))[0] is Cause.INFRA
    lost = attempt(
        signal=None, closed_from_ledger=True, reason="its supervisor was lost (killed) while it ran"
    )
    assert classify_failure(lost)[0] is Cause.INFRA
    assert classify_failure(attempt(reason="cannot start: [Errno 2]", code=127))[0] is Cause.USER
    assert classify_failure(attempt(reason="exit status 3"))[0] is Cause.USER  # before its first step
    trained = replace(attempt(reason="exit status 3"), training_start_ts=0.5, last_step=4)
    assert classify_failure(trained)[0] is Cause.UNKNOWN  # a bare exit status after training
    assert classify_failure(attempt(closed=True))[0] is Cause.UNKNOWN
    assert classify_failure(attempt(Outcome.PREEMPTED, signal="SIGTERM"))[0] is Cause.PREEMPTION
    assert classify_failure(attempt(Outcome.HUNG))[0] is Cause.HANG


def test_report_json_and_text_show_failures_by_cause():
    from ettr.report.json import to_dict
    from ettr.report.text import render

    report = _report(JobSpec(job_id="j", fail_at_steps=(30,), failure_kind="infra"))
    out = to_dict(report, include_segments=False)
    assert out["num_failures_by_cause"]["infra"] == 1 and out["num_infra_failures"] == 1
    assert out["ttr_s_by_cause"]["infra"] == pytest.approx(list(report.ttr_s))
    assert out["failures"][0]["cause"] == "infra"
    assert "failures by cause (NoF, mean TTR): infra 1" in render(report)


# -- regressions ---------------------------------------------------------------------------------------------
def _summary(
    i: int, family: str = "f", *, compile_s: float = 3.0, init_s: float = 5.0, **extra
) -> JobSummary:
    buckets = dict.fromkeys(Bucket, 0.0)
    buckets.update({Bucket.COMPILE: compile_s, Bucket.INIT: init_s, Bucket.EFFECTIVE_TRAINING: 100.0})
    wall = sum(buckets.values())
    fields = dict(job_id=f"{family}-{i}", family=family, source="x", gpus=1, gpus_source="world_size",
                  wall_start_ts=T0 + i * 100, wall_end_ts=T0 + i * 100 + wall, wall_s=wall,
                  ett_pct=100.0 * 100 / wall, idleness_pct=100 - 100.0 * 100 / wall, failure_pct=0.0,
                  tts_s=compile_s + init_s, ttr_s=(), num_failures=0, buckets_s=buckets, failures=(),
                  num_attempts=1, last_attempt=0, in_progress=False, running=False, last_commit_ts=None,
                  progress_start_ts=None)  # fmt: skip
    fields.update(extra)
    return JobSummary(**fields)


def _unknown_ett_summary(why: str) -> JobSummary:
    """A job of family `b` that spent 50 s in init and whose ETT is unknown (`why`); its number stays 0."""
    buckets = dict.fromkeys(Bucket, 0.0)
    buckets[Bucket.INIT] = 50.0
    return replace(
        _summary(1, "b"), buckets_s=buckets, wall_s=50.0, wall_end_ts=T0 + 150.0, ett_pct=0.0,
        idleness_pct=100.0, ett_unknown=why,
    )  # fmt: skip


def test_compile_doubling_from_one_job_on_is_flagged_at_that_job():
    rng = random.Random(3)
    jobs = [_summary(i, compile_s=3.0 * rng.uniform(0.95, 1.05) * (2 if i >= 6 else 1)) for i in range(9)]
    found = find_regressions(jobs)
    compile_ = next(r for r in found if r.metric == "compile")
    assert compile_.job_id == "f-6" and compile_.family == "f"
    assert compile_.baseline == pytest.approx(3.0, rel=0.06) and compile_.value == pytest.approx(
        6.0, rel=0.06
    )
    assert found[0].metric == "compile"  # the largest relative change first
    assert {r.metric for r in found} <= {"compile", "tts_s", "ett_pct"}


def test_a_change_in_the_newest_job_alone_is_flagged():
    jobs = [_summary(i) for i in range(5)] + [_summary(5, compile_s=6.0)]
    assert [(r.metric, r.job_id) for r in find_regressions(jobs) if r.metric == "compile"] == [
        ("compile", "f-5")
    ]


@pytest.mark.parametrize("seed", range(20))
def test_stable_noisy_families_are_not_flagged(seed):
    rng = random.Random(seed)
    # Real timing noise: +-15% jitter and a rare slow start-up (a loaded machine) that does not persist.
    jobs = []
    for i in range(12):
        slow = 1.5 if rng.random() < 0.1 and i < 11 else 1.0
        jobs.append(
            _summary(i, compile_s=3.0 * rng.uniform(0.85, 1.15), init_s=5.0 * rng.uniform(0.85, 1.15) * slow)
        )
    assert find_regressions(jobs) == []


def test_the_noise_of_a_few_jobs_is_not_underestimated():
    # Three jobs' MAD x 1.4826 averages 0.68 of the noise's standard deviation: a newest job 1.4 s slower to
    # start than three within 0.2 s of each other cleared "8 deviations" and the floors (25%, 1 s), and
    # identical jobs on a loaded node were reported (field trial: shutdown 4.49 -> 6.94 s).
    from ettr.fleet.regress import MAD_TO_SIGMA, noise_sigma

    assert noise_sigma([5.0, 5.1, 5.2], 5.1) == pytest.approx(1.495 * MAD_TO_SIGMA * 0.1)
    assert noise_sigma([1.0] * 20, 0.0) == pytest.approx(20 / 19.2 * MAD_TO_SIGMA)
    jobs = [_summary(i, init_s=v) for i, v in enumerate([5.0, 5.1, 5.2, 6.6])]
    assert [r for r in find_regressions(jobs) if r.metric == "init"] == []
    jobs = [_summary(i, init_s=v) for i, v in enumerate([5.0, 5.1, 5.2, 7.5])]  # beyond that noise
    assert [r.job_id for r in find_regressions(jobs) if r.metric == "init"] == ["f-3"]


def test_a_spike_is_not_a_regression_and_a_fixed_one_is_no_longer_reported():
    spike = [_summary(i, compile_s=9.0 if i == 4 else 3.0) for i in range(8)]
    assert find_regressions(spike) == []
    fixed = [_summary(i, compile_s=6.0 if 4 <= i < 6 else 3.0) for i in range(12)]
    assert find_regressions(fixed) == []


def _paced(i: int, step_s: float, *, steps: int = 1000, other_s: float = 20.0) -> JobSummary:
    """Job i of a family that runs `steps` steps of `step_s` each, plus `other_s` of start-up."""
    train = steps * step_s
    return _summary(i, init_s=other_s - 3.0, step_time_s=step_s,
                    buckets_s={**dict.fromkeys(Bucket, 0.0), Bucket.INIT: other_s - 3.0, Bucket.COMPILE: 3.0,
                               Bucket.EFFECTIVE_TRAINING: train},
                    wall_s=train + other_s, ett_pct=100.0 * train / (train + other_s),
                    idleness_pct=100.0 * other_s / (train + other_s))  # fmt: skip


def test_slower_steps_are_a_regression_not_an_ett_gain():
    # The same work at a slower step is more effective training: a higher ETT%, which no other metric flags
    # (ETT% is checked for drops only). The median step time is checked for a sustained rise.
    rng = random.Random(3)
    jobs = [_paced(i, 0.200 * rng.uniform(0.98, 1.02)) for i in range(6)]
    jobs += [_paced(i, 0.300 * rng.uniform(0.98, 1.02)) for i in range(6, 9)]
    assert jobs[-1].ett_pct > max(j.ett_pct for j in jobs[:6])  # it reads as a gain
    found = find_regressions(jobs)
    assert [(r.metric, r.job_id, r.num_changed_jobs) for r in found] == [("step_time_s", "f-6", 3)]
    assert found[0].baseline == pytest.approx(0.2, rel=0.03) and found[0].value == pytest.approx(
        0.3, rel=0.03
    )
    from ettr.fleet.text import regression_line

    assert re.search(r"step_time_s 19\d\.\d ms -> 29\d\.\d ms from job f-6", regression_line(found[0]))
    # Noise within the family's own spread, a lone slow job, a faster step and a slow-down since fixed: none.
    assert find_regressions([_paced(i, 0.200 * rng.uniform(0.9, 1.1)) for i in range(12)]) == []
    assert find_regressions([_paced(i, 0.3 if i == 6 else 0.2) for i in range(10)]) == []
    assert find_regressions([_paced(i, 0.1 if i >= 6 else 0.2) for i in range(9)]) == []
    assert find_regressions([_paced(i, 0.3 if 6 <= i < 8 else 0.2) for i in range(14)]) == []
    # 5% slower is within the step speed warning's tolerance: not a regression however steady the family.
    assert find_regressions([_paced(i, 0.21 if i >= 6 else 0.2) for i in range(9)]) == []


def test_families_are_judged_against_their_own_history_only():
    jobs = [_summary(i, "fast", compile_s=1.0) for i in range(5)] + [
        _summary(i, "slow", compile_s=30.0) for i in range(5)
    ]
    assert find_regressions(jobs) == []
    with pytest.raises(ValueError, match="min_baseline"):
        RegressionConfig(min_baseline=1)


def test_running_jobs_are_not_judged_yet():
    jobs = [_summary(i) for i in range(5)] + [_summary(5, compile_s=9.0, in_progress=True, running=True)]
    assert find_regressions(jobs) == []


# -- aggregation ---------------------------------------------------------------------------------------------
def test_fleet_shares_are_weighted_by_wall_time_times_gpus():
    small = _summary(0, "a", gpus=1)
    big = replace(_summary(1, "b", compile_s=50.0), gpus=8)
    report = build_fleet([small, big])
    expected = (small.ett_pct * small.wall_s + big.ett_pct * big.wall_s * 8) / (small.wall_s + big.wall_s * 8)
    assert report.fleet.ett_pct == pytest.approx(expected)
    assert report.fleet.bucket_gpu_s[Bucket.COMPILE] == pytest.approx(3.0 + 50.0 * 8)
    assert report.costliest_buckets[0][0] is Bucket.COMPILE
    assert report.worst_jobs[0].job_id == big.job_id
    assert set(report.families) == {"a", "b"}
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_a_job_whose_ett_is_unknown_is_left_out_of_the_fleets_shares_gauges_and_regressions():
    """A job that ended without a training step seen (an inference job) has ETT unknown, not 0 %: the fleet's
    shares, the worst jobs, the per-job gauge and the ett_pct regressions leave it out; its JSON ett_pct is
    null; a stored summary round-trips it; one stored before the field existed still reads."""
    from ettr.fleet import json as fleet_json
    from ettr.fleet import text as fleet_text
    from ettr.fleet.metrics import metric_families
    from ettr.fleet.model import summary_from_json, summary_to_json

    trained = _summary(0, "a")
    inference = _unknown_ett_summary("no training step seen")
    report = build_fleet([trained, inference])
    assert report.fleet.ett_pct == pytest.approx(trained.ett_pct)
    assert report.fleet.ett_pct + report.fleet.idleness_pct + report.fleet.failure_pct == pytest.approx(100.0)
    assert report.fleet.num_ett_unknown == 1
    assert [j.job_id for j in report.worst_jobs] == [trained.job_id]
    out = fleet_json.to_dict(report)
    assert out["ett_pct"] == pytest.approx(trained.ett_pct) and out["jobs_ett_unknown"] == 1
    by_id = {j["job_id"]: j for j in out["jobs"]}
    assert by_id[inference.job_id]["ett_unknown"] == "no training step seen"
    assert (
        by_id[trained.job_id]["ett_pct"] == trained.ett_pct and by_id[trained.job_id]["ett_unknown"] is None
    )
    assert "1 job(s) with ETT unknown" in fleet_text.render(report)
    gauges = {
        s.labels["job"]: s.value
        for family in metric_families([trained, inference], now=T0 + 1000)
        if family.name == "ettr_effective_training_ratio"
        for s in family.samples
    }
    assert set(gauges) == {trained.job_id}
    history = [replace(inference, job_id=f"b-{i}", wall_start_ts=T0 + i) for i in range(2, 12)]
    assert [
        r
        for r in find_regressions([*[_summary(i, "b") for i in range(8)], *history])
        if r.metric == "ett_pct"
    ] == []
    assert summary_from_json(summary_to_json(inference)) == inference
    older = summary_to_json(trained)
    del older["ett_unknown"]
    assert summary_from_json(older).ett_unknown is None


def test_a_fleet_of_jobs_whose_ett_is_unknown_says_unknown_not_0_percent():
    """Every job ended without a training step seen (a wrapper hid the trainers from ettr): the fleet's shares
    are 0 of nothing. The text and the dashboard read "ETT unknown" (they read "ETT 0.0%"), the fleet gauge
    has no sample; the JSON keeps its number beside jobs_ett_unknown."""
    from ettr.fleet import json as fleet_json
    from ettr.fleet import text as fleet_text
    from ettr.fleet.html import render_html
    from ettr.fleet.metrics import metric_families

    hidden = _unknown_ett_summary("no process of the job reported to ettr")
    report = build_fleet([hidden])
    assert not report.fleet.ett_known and report.fleet.shares_pct() is None
    text = fleet_text.render(report)
    assert "ETT unknown | idle - | failure - |" in text and "ETT 0.0%" not in text
    family_row = next(line for line in text.splitlines() if line.lstrip().startswith(hidden.family))
    assert "unknown" in family_row and "0.0" not in family_row.split()
    page = render_html(report)
    assert "ETT unknown" in page and "ETT 0.0%" not in page
    samples = [
        s
        for family in metric_families([hidden], now=T0 + 1000)
        if family.name == "ettr_fleet_effective_training_ratio"
        for s in family.samples
    ]
    assert samples == []
    out = fleet_json.to_dict(report)
    assert out["ett_pct"] == 0.0 and out["jobs_ett_unknown"] == 1
    trained = build_fleet([hidden, _summary(0, "a")])
    assert trained.fleet.ett_known and "| ETT unknown |" not in fleet_text.render(trained).splitlines()[0]


# -- preemption ----------------------------------------------------------------------------------------------
def test_a_job_that_just_committed_is_cheaper_to_preempt():
    now = T0 + 1000
    base = dict(in_progress=True, running=True, progress_start_ts=T0 + 100, ttr_s=(20.0,))
    just = _summary(0, last_commit_ts=now - 2, **base)
    stale = _summary(1, last_commit_ts=now - 300, **base)
    never = _summary(2, last_commit_ts=None, **base)
    done = _summary(3)  # finished: not a candidate
    costs = preemption_costs([stale, never, done, just], now)
    assert [c.job_id for c in costs] == ["f-0", "f-1", "f-2"]
    assert costs[0].unsaved_s == pytest.approx(2.0) and costs[0].recovery_s == 20.0
    assert costs[0].cost_gpu_s == pytest.approx(22.0)
    assert costs[2].unsaved_s == pytest.approx(900.0)  # never committed: everything since it began training
    victims, enough = choose_victims(costs, 2)
    assert [v.job_id for v in victims] == ["f-0", "f-1"] and enough
    assert choose_victims(costs, 10)[1] is False


def test_recovery_time_falls_back_to_the_family_then_to_tts():
    now = T0 + 1000
    history = _summary(0, ttr_s=(40.0, 60.0))
    fresh = _summary(1, in_progress=True, running=True, progress_start_ts=now - 10)
    lonely = _summary(2, "other", in_progress=True, running=True, progress_start_ts=now - 10)
    costs = {c.job_id: c for c in preemption_costs([history, fresh, lonely], now)}
    assert costs["f-1"].recovery_source == "family_ttr" and costs["f-1"].recovery_s == 50.0
    assert costs["other-2"].recovery_source == "tts" and costs["other-2"].recovery_s == lonely.tts_s


# -- the command over run directories ------------------------------------------------------------------------
@pytest.fixture
def runs(tmp_path):
    for i in range(6):
        write_job(tmp_path / "runs" / f"a{i}", JobSpec(job_id=f"a{i}", family="alpha", start_ts=T0 + i * 1000,
                                                       compile_s=6.0 if i >= 4 else 3.0))  # fmt: skip
    for i in range(4):
        spec = JobSpec(job_id=f"b{i}", family="beta", start_ts=T0 + i * 1000 + 50, world_size=4,
                       fail_at_steps=(30,) if i == 2 else (), failure_kind="infra")  # fmt: skip
        write_job(tmp_path / "runs" / "nested" / f"b{i}", spec)
    return tmp_path / "runs"


def test_fleet_json_has_the_contract_keys_and_finds_the_regression(runs, capsys):
    assert main(["fleet", str(runs), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "ettr.fleet/1"
    assert len(out["jobs"]) == 10
    for job in out["jobs"]:
        assert {"job_id", "family", "wall_s", "ett_pct", "tts_s", "num_failures", "gpus", "start_ts"} <= set(
            job
        )
    assert {j["job_id"]: j["gpus"] for j in out["jobs"]}["b0"] == 4
    wall_gpu = sum(j["wall_s"] * j["gpus"] for j in out["jobs"])
    assert out["ett_pct"] == pytest.approx(
        sum(j["ett_pct"] * j["wall_s"] * j["gpus"] for j in out["jobs"]) / wall_gpu
    )
    assert out["num_failures_by_cause"]["infra"] == 1
    compile_ = [r for r in out["regressions"] if r["metric"] == "compile"]
    assert len(compile_) == 1 and compile_[0]["job_id"] == "a4" and compile_[0]["family"] == "alpha"
    assert {"job_id", "family", "metric", "baseline", "value"} <= set(compile_[0])
    assert compile_[0]["baseline"] == pytest.approx(3.0) and compile_[0]["value"] == pytest.approx(6.0)
    assert all(r["family"] == "alpha" for r in out["regressions"])  # beta is stable (one infra failure)
    assert set(out["families"]) == {"alpha", "beta"}


def test_fleet_check_exit_status(runs, tmp_path, capsys):
    assert main(["fleet", str(runs), "--check"]) == 1
    text = capsys.readouterr().out
    assert "alpha: compile 3.00 s -> 6.00 s from job a4" in text
    assert main(["fleet", str(runs / "nested"), "--check"]) == 0  # beta alone: stable
    assert main(["fleet", str(runs / "a0"), str(runs / "a1"), "--check"]) == 0  # one run dir each, too short


def test_fleet_since_and_html(runs, tmp_path, capsys):
    page = tmp_path / "fleet.html"
    assert main(["fleet", str(runs), "--since", str(T0 + 3500), "--json", "--html", str(page)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(j["job_id"] for j in out["jobs"]) == ["a4", "a5"]
    assert [r["job_id"] for r in out["regressions"] if r["metric"] == "compile"] == ["a4"]
    html = page.read_text()
    assert (
        html.startswith("<!DOCTYPE html>")
        and "regression-mark" in html
        and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    )


def test_preempt_order_from_run_dirs(tmp_path, capsys):
    runs = tmp_path / "runs"
    # Jobs of a supervisor on another host, active a minute ago: running (their pids cannot be checked).
    elsewhere = dict(
        running=True, host="another-host", num_steps=40, ckpt_every=20, start_ts=time.time() - 80
    )
    write_job(runs / "committed", JobSpec(job_id="committed", **elsewhere))  # committed at its last step
    write_job(runs / "uncommitted", JobSpec(job_id="uncommitted", **{**elsewhere, "num_steps": 39}))
    write_job(runs / "done", JobSpec(job_id="done"))
    assert main(["fleet", str(runs), "--preempt-order", "--need-gpus", "1", "--json"]) == 0
    order = json.loads(capsys.readouterr().out)["preempt_order"]
    assert [o["job_id"] for o in order["order"]] == ["committed", "uncommitted"]
    assert order["victims"] == ["committed"] and order["enough"] is True
    assert main(["fleet", str(runs), "--preempt-order"]) == 0
    assert "cheapest first" in capsys.readouterr().out
    assert main(["fleet", str(runs), "--json"]) == 0
    jobs = {j["job_id"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert jobs["committed"]["running"] and jobs["committed"]["num_failures"] == 0  # running is not failing
    assert jobs["committed"]["failures"] == []


def test_a_silent_job_of_another_hosts_supervisor_is_not_running(tmp_path, capsys):
    spec = JobSpec(
        job_id="lost", running=True, host="another-host", num_steps=10, start_ts=time.time() - 3600
    )
    write_job(tmp_path / "lost", spec)  # its supervisor was lost an hour ago without a JOB_END
    assert main(["fleet", str(tmp_path), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["in_progress"] and not job["running"]
    assert job["wall_s"] < 60  # closed at its last event, not stretched to now
    # Its supervisor is lost: how its open attempt ended is unknown, so no failure is counted until a requeue
    # says what happened (docs/buckets.md, "Jobs without an end").
    assert job["failures"] == [] and job["num_failures"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fleet"], "give run directories or --ledger"),
        (["fleet", "/nonexistent/runs"], "no such file or directory"),
        (["fleet", "{tmp}"], "no ettr run directory"),
        (["fleet", "{tmp}", "--need-gpus", "2"], "--need-gpus goes with --preempt-order"),
        (["fleet", "{tmp}", "--since", "yesterday"], "is not a time"),
        (["serve", "/nonexistent/runs"], "no such file or directory"),
        (["serve", "{tmp}", "--port", "99999"], "not a port number"),
        (["fleet", "--ledger", "sqlite:///{tmp}/x.db"], "sqlite:///"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"ettr {argv[0]}")


def test_an_unreadable_run_dir_is_skipped_and_named(runs, capsys):
    (runs / "broken").mkdir()
    (runs / "broken" / "ledger.db").write_bytes(b"not a database at all" * 100)
    assert main(["fleet", str(runs), "--json"]) == 0
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "broken" in captured.err
    assert len(json.loads(captured.out)["problems"]) == 1


def _unlistable(monkeypatch, folder):
    """Listing `folder` fails as a folder without permission does (root reads every folder, so a chmod cannot
    make one in a test run as root)."""
    import os

    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", str(folder))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def test_a_folder_that_cannot_be_searched_is_named_not_passed_over(runs, monkeypatch, capsys):
    # Its jobs are missing from every figure: the fleet says so in one line and lists it under problems (it
    # passed over the folder in silence: a fleet ETT of the jobs it could see, with no word of the others).
    _unlistable(monkeypatch, runs / "nested")
    assert main(["fleet", str(runs), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["jobs"]) == 6 and len(out["problems"]) == 1
    assert str(runs / "nested") in out["problems"][0] and "Permission denied" in out["problems"][0]
    assert captured.err.count("ettr fleet: skipped ") == 1 and "cannot be searched" in captured.err
    assert main(["fleet", str(runs / "nested")]) == 2  # nothing else to read: why there is nothing, one line
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot be searched (Permission denied)" in err


def test_serve_counts_a_folder_that_cannot_be_searched_as_unreadable(runs, monkeypatch):
    from argparse import Namespace

    from ettr.fleet.serve import loader

    _unlistable(monkeypatch, runs / "nested")
    args = Namespace(run_dirs=[str(runs)], ledger=None, workers=1, no_cache=True, cache_dir=None,
                     from_events=False, window=None)  # fmt: skip
    jobs, problems = loader(args)(time.time())
    assert len(jobs) == 6 and len(problems) == 1 and "cannot be searched" in problems[0]


def test_run_dirs_on_a_server_that_does_not_answer_cost_one_try_not_one_each(runs, monkeypatch, capsys):
    # A server that is down or stalled costs its connect timeout (3-5 s) per try: tried once per run directory,
    # 12 run directories on a stalled server took 40 s (a scrape of ettr serve ran past its deadline).
    import ettr.ledger.postgres as pg

    url = "postgresql://ettr@db.invalid:5432/ettr"
    for i in range(12):
        (runs / "shared" / f"s{i}").mkdir(parents=True)
        (runs / "shared" / f"s{i}" / "ledger-url.json").write_text(
            json.dumps({"url": url, "job_id": f"s{i}"})
        )
    tried: list[str] = []

    def unanswered(u):
        tried.append(u)
        return f"ledger {u}: connection timeout expired"

    monkeypatch.setattr(pg, "unanswered", unanswered)
    monkeypatch.setattr(
        pg.PostgresLedger, "__init__", lambda *a, **k: pytest.fail("a run directory was tried")
    )
    assert main(["fleet", str(runs), "--json", "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert len(tried) == 1 and tried[0].startswith(url)  # the URL as read from a run directory (restricted)
    out = json.loads(captured.out)
    assert len(out["jobs"]) == 10 and len(out["problems"]) == 12  # each run directory still named, once
    assert all("connection timeout expired" in p for p in out["problems"])
    assert captured.err.count("ettr fleet: skipped ") == 12


def test_a_server_that_refuses_is_unanswered_at_once():
    import socket

    from ettr.ledger.postgres import unanswered

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = unanswered(f"postgresql://ettr:secret@127.0.0.1:{port}/ettr")
    assert why is not None and "secret" not in why and "***" in why and "\n" not in why


def test_a_server_that_answers_is_not_unanswered(postgres_url):
    from ettr.ledger.postgres import unanswered

    assert unanswered(postgres_url) is None


def test_what_a_skipped_line_names_is_printed_without_control_characters(runs, capsys):
    # A run directory's name (or a URL read from its pointer) is anyone's text: stdout's "not read" list
    # escaped it, stderr's "skipped" line wrote it raw (ESC [ 2 J clears the operator's terminal).
    bad = runs / "x\x1b[2J\x1b]52;c;ZXZpbA==\x07y"
    bad.mkdir()
    (bad / "ledger.db").write_bytes(b"not a database" * 100)
    assert main(["fleet", str(runs), "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert "\x1b" not in captured.err and "\x07" not in captured.err
    assert "skipped" in captured.err and "x\\x1b[2J" in captured.err and "\x1b" not in captured.out


def test_serve_names_each_unreadable_ledger_once_on_stderr(runs, caplog):
    # ettr_jobs_unreadable said how many; nothing said which, or why.
    import logging
    from argparse import Namespace

    from ettr.fleet.serve import loader

    (runs / "broken").mkdir()
    (runs / "broken" / "ledger.db").write_bytes(b"not a database" * 100)
    args = Namespace(run_dirs=[str(runs)], ledger=None, workers=1, no_cache=True, cache_dir=None,
                     from_events=False, window=None)  # fmt: skip
    load = loader(args)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        for _ in range(3):
            jobs, problems = load(time.time())
            assert len(jobs) == 10 and len(problems) == 1
    named = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(named) == 1 and str(runs / "broken") in named[0] and "not a readable ettr ledger" in named[0]
    (runs / "broken" / "ledger.db").unlink()
    (runs / "broken").rmdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ettr"):
        assert load(time.time())[1] == []
        (runs / "broken").mkdir()
        (runs / "broken" / "ledger.db").write_bytes(b"not a database" * 100)
        assert len(load(time.time())[1]) == 1  # back after it was gone: named again
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1
    caplog.clear()
    args.run_dirs, args.ledger = [], "postgresql://ettr@127.0.0.1:1/ettr"  # nothing listens on port 1
    with caplog.at_level(logging.WARNING, logger="ettr"):
        assert load(time.time())[0] == []
    (said,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert said.startswith("ettr serve: skipped ledger postgresql://") and said.count("ettr serve") == 1


def test_a_skipped_ledger_says_what_reading_it_found(runs, capsys):
    # The fleet opens every ledger read-only, and said "(opened read-only)" of any file it could not read
    # (another program's SQLite file, an empty one), where `ettr report` said what was wrong with it.
    import sqlite3

    (runs / "other").mkdir()
    with contextlib.closing(sqlite3.connect(runs / "other" / "ledger.db")) as conn:
        conn.execute("CREATE TABLE events (x)")
        conn.commit()
    (runs / "empty").mkdir()
    (runs / "empty" / "ledger.db").write_bytes(b"")
    (runs / "dangling").mkdir()
    (runs / "dangling" / "ledger.db").symlink_to("ledger.db")  # a loop
    assert main(["fleet", str(runs), "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert err.count("ettr fleet: skipped ") == 3 and "opened read-only" not in err
    assert err.count("(no such table: meta)") == 2
    assert "dangling/ledger.db (a symbolic link that leads to no file)" in err


def test_a_second_run_reads_finished_jobs_from_the_cache_until_a_ledger_changes(runs, tmp_path, capsys):
    from ettr.events import SUPERVISOR_RANK, Event, EventKind
    from ettr.ledger import open_ledger

    cache = tmp_path / "cache" / "ettr" / "fleet"
    assert main(["fleet", str(runs), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(list(cache.glob("*.json"))) == 10
    for path in cache.glob("*.json"):  # mark the numbers: a second run must read them, not the ledgers
        data = json.loads(path.read_text())
        data["summary"]["tts_s"] = 12345.0  # a valid figure (an impossible one is refused: see below)
        path.write_text(json.dumps(data))
    assert main(["fleet", str(runs), "--json"]) == 0
    assert {j["tts_s"] for j in json.loads(capsys.readouterr().out)["jobs"]} == {12345.0}
    assert main(["fleet", str(runs), "--json", "--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out) == first
    ledger = open_ledger(runs / "a0", create=False)  # a requeued job appends: its entry is stale
    ledger.append([Event(EventKind.MARK, T0 + 10**5, 0, SUPERVISOR_RANK, data={"name": "x"})])
    ledger.close()
    assert main(["fleet", str(runs), "--json"]) == 0
    tts = {j["job_id"]: j["tts_s"] for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert tts["a0"] == first["jobs"][0]["tts_s"] and tts["a1"] == 12345.0
    (cache / "garbage.json").write_text("{")
    for path in cache.glob("*.json"):
        path.write_text("not json")
    assert main(["fleet", str(runs), "--json"]) == 0  # an unreadable cache only costs time
    assert json.loads(capsys.readouterr().out)["jobs"] == first["jobs"]


def test_the_summary_cache_ignores_a_relative_xdg_cache_home(monkeypatch, tmp_path):
    # XDG_CACHE_HOME=cache named ./cache/ettr/fleet of whatever folder `ettr fleet` ran in (a cron job's, a
    # shared one); every other cache of ettr (compile store, warm memo) falls back to ~/.cache as the XDG spec says.
    from ettr.fleet.load import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    assert default_cache_dir() == Path(os.path.expanduser("~/.cache"), "ettr", "fleet")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "ettr" / "fleet"


# -- the fleet's read of a ledger ----------------------------------------------------------------------------
def _random_job(rng: random.Random) -> list:
    """A job whose ranks write steps and phases out of step with each other; some attempts lack rank 0, some
    have no supervisor, some events share timestamps."""
    from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase

    events = []
    t = T0
    supervised = rng.random() < 0.5
    if supervised:
        events.append(Event(EventKind.SUPERVISOR_START, t, 0, SUPERVISOR_RANK, data={"pid": 1}))
    for attempt in range(rng.choice((1, 2, 3, 3))):
        ranks = rng.sample(range(4), rng.randint(2, 4))
        if supervised:
            events.append(Event(EventKind.ATTEMPT_START, t, attempt, SUPERVISOR_RANK))
        for rank in ranks:
            events.append(
                Event(EventKind.PROCESS_START, t + rng.random(), attempt, rank, data={"world_size": 4})
            )
        for n in range(rng.randint(0, 30)):
            t += rng.choice((0.0, 0.1, 0.5))
            for rank in ranks:
                kind = rng.choice(
                    (EventKind.STEP, EventKind.STEP, EventKind.PHASE_BEGIN, EventKind.PHASE_END)
                )
                phase = (
                    None
                    if kind is EventKind.STEP
                    else rng.choice((Phase.INIT, Phase.COMPILE, Phase.CHECKPOINT_BLOCKING))
                )
                value = t - 0.05 if kind is EventKind.PHASE_END else None
                events.append(
                    Event(
                        kind,
                        t + rng.random() * 0.2,
                        attempt,
                        rank,
                        phase,
                        n if kind is EventKind.STEP else None,
                        value,
                    )
                )
            if rng.random() < 0.1:
                events.append(
                    Event(
                        EventKind.CHECKPOINT_COMMIT, t, attempt, rng.choice(ranks), step=n, data={"path": "p"}
                    )
                )
        if rng.random() < 0.3:
            events.append(Event(EventKind.RESUMED, t, attempt, rng.choice(ranks), step=rng.randint(0, 5)))
        if rng.random() < 0.5:  # a straggler rank steps after the others
            events.append(Event(EventKind.STEP, t + 0.5, attempt, max(ranks), step=99))
        t += 1.0
        if supervised and rng.random() < 0.8:
            events.append(
                Event(
                    EventKind.ATTEMPT_END,
                    t,
                    attempt,
                    SUPERVISOR_RANK,
                    data={"outcome": "failed", "exit_code": 1},
                )
            )
    if supervised and rng.random() < 0.7:
        events.append(Event(EventKind.JOB_END, t + 1, 0, SUPERVISOR_RANK, data={"exit_status": 1}))
    rng.shuffle(events)  # append order is not time order across processes
    return events


@pytest.mark.parametrize("seed", range(60))
def test_the_fleets_read_gives_the_same_report_as_the_full_ledger(seed, tmp_path):
    from ettr.ledger import Books, open_ledger
    from ettr.report.json import to_dict

    rng = random.Random(seed)
    if seed % 4 == 0:
        spec = JobSpec(job_id="j", world_size=rng.choice((2, 8)), fail_at_steps=(30,), num_steps=60)
        write_job(tmp_path, spec)
    else:
        ledger = open_ledger(tmp_path)
        ledger.append(_random_job(rng))
        ledger.close()
    ledger = open_ledger(tmp_path, create=False)
    full = ledger.read()
    ledger.close()
    fewer = Books(tmp_path).read_marked(for_accounting=True)[0]
    assert len(fewer) <= len(full)
    now = max(e.ts for e in full) + 5
    few, whole = to_dict(compute(fewer, now, job_id="j")), to_dict(compute(full, now, job_id="j"))
    # Everything but the slow-rank check, which needs every rank's steps: the fewer rows cannot tell it, and
    # say so (unknown, not "none").
    assert not few["rank_speed"]["checked"] or few["rank_speed"] == whole["rank_speed"]
    for data in (few, whole):
        del data["rank_speed"], data["slow_steps"]["straggler_s"]
    assert few == whole


@pytest.mark.slow
def test_worker_processes_read_the_same_summaries(tmp_path):
    from ettr.fleet.load import find_run_dirs, load_run_dirs

    for i in range(16):
        spec = JobSpec(job_id=f"w{i}", start_ts=T0 + i, num_steps=20, world_size=1 + i % 3,
                       fail_at_steps=(10,) if i % 5 == 0 else ())  # fmt: skip
        write_job(tmp_path / f"w{i}", spec)
    run_dirs = find_run_dirs([tmp_path])
    alone, _ = load_run_dirs(run_dirs, now=T0, workers=1)
    pooled, problems = load_run_dirs(run_dirs, now=T0, workers=2)
    assert not problems and pooled == alone and len(pooled) == 16


# -- step speed ----------------------------------------------------------------------------------------------
def test_jobs_whose_steps_ran_more_than_10_percent_off_their_family_are_listed():
    from ettr.fleet.aggregate import build_fleet
    from ettr.fleet.json import to_dict
    from ettr.fleet.text import render

    jobs = [_summary(i, step_time_s=0.050) for i in range(3)]
    jobs += [_summary(3, step_time_s=0.081), _summary(4, step_time_s=0.054)]  # +62%, +8%
    jobs += [_summary(0, "g", step_time_s=1.0), _summary(1, "lone", step_time_s=9.0)]  # g, lone: one job each
    jobs += [_summary(5, step_time_s=None)]  # unknown: not compared, and it does not move the median
    report = build_fleet(jobs)
    assert [(o.job_id, round(o.change, 2)) for o in report.step_speed] == [("f-3", 0.62)]
    assert report.step_speed[0].family_step_time_s == 0.050 and report.step_speed[0].num_family_jobs == 5
    data = to_dict(report)
    assert data["step_speed_outliers"][0]["job_id"] == "f-3"
    assert {j["job_id"]: j["step_time_s"] for j in data["jobs"]}["f-5"] is None
    text = render(report)
    assert "warning: f-3 (f): median step 81.0 ms, 62% slower than its family's 50.0 ms (of 5 jobs)" in text
    assert "step speed" in render(build_fleet(jobs[:3])) and "(none)" in render(build_fleet(jobs[:3]))


def test_a_running_jobs_wall_counter_never_drops_when_its_end_is_recorded():
    """`ettr_wall_seconds_total` is a counter: a running job's report is closed at the scrape's `now`, and
    its JOB_END, recorded a moment later (or the job found lost, closed at its last event), came before a
    `now` already scraped: the counter dropped (100 -> 95 below), which Prometheus reads as a reset, the
    job's whole wall time again. A running job counts to its newest event; a stored summary round-trips it."""
    from ettr.fleet.metrics import metric_families
    from ettr.fleet.model import summary_from_json, summary_to_json

    def wall_counter(job: JobSummary, now: float) -> float:
        (value,) = [
            s.value
            for family in metric_families([job], now=now)
            if family.name == "ettr_wall_seconds"
            for s in family.samples
            if s.name == "ettr_wall_seconds_total"
        ]
        return value

    start = T0 + 1000.0
    buckets = dict.fromkeys(Bucket, 0.0)
    buckets[Bucket.EFFECTIVE_TRAINING] = 100.0
    running = replace(
        _summary(0), wall_start_ts=start, wall_end_ts=start + 100.0, wall_s=100.0, buckets_s=buckets,
        ett_pct=100.0, idleness_pct=0.0, in_progress=True, running=True, last_event_ts=start + 90.0,
    )  # fmt: skip
    buckets_end = dict.fromkeys(Bucket, 0.0)
    buckets_end[Bucket.EFFECTIVE_TRAINING] = 95.0
    ended = replace(
        running, wall_end_ts=start + 95.0, wall_s=95.0, buckets_s=buckets_end, in_progress=False,
        running=False, last_event_ts=start + 95.0,
    )  # fmt: skip
    seen = [wall_counter(running, start + 100.0), wall_counter(ended, start + 110.0)]
    assert seen == [pytest.approx(90.0), pytest.approx(95.0)]
    assert seen == sorted(seen)
    assert summary_from_json(summary_to_json(ended)) == ended
    older = summary_to_json(ended)
    del older["last_event_ts"]
    assert summary_from_json(older).last_event_ts is None


def test_prometheus_label_values_carry_no_raw_control_characters():
    """A run directory named with an ESC sequence: its `name` label reached `/metrics` raw (the exposition
    format escapes only backslash, quote and newline) and a terminal showing it ran the sequence."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from ettr.fleet.metrics import FleetCollector

    job = _summary(0, name="run\x1b]52;c;ZXZpbA==\x07")
    registry = CollectorRegistry()
    registry.register(FleetCollector(lambda now: ([job], []), clock=lambda: T0 + 1000))
    text = generate_latest(registry).decode()
    assert "\x1b" not in text and "\x07" not in text
    assert 'name="run\\\\x1b]52;c;ZXZpbA==\\\\x07"' in text


def test_every_nodes_run_dir_of_a_multi_node_job_is_one_job(tmp_path, capsys):
    # Field trial: two nodes of one job (`ettr run --ledger URL --job-id J` each, a run directory each, both
    # pointing at the job's books): `ettr fleet node0 node1` listed the job twice, its GPU-hours doubled.
    from ettr.ledger.url import write_pointer
    from ettr.testing.fleet import write_job_url

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    write_job_url(url, JobSpec(job_id="two-nodes", world_size=2))
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
        write_pointer(tmp_path / node, url, job_id="two-nodes")
    other = tmp_path / "other"
    # the same job id in its own books, started at another instant: another job (at the same instant to the
    # microsecond it would be a copy of these books: `drop_copies`)
    write_job(other, JobSpec(job_id="two-nodes", start_ts=1_700_000_500.0))
    assert (
        main(["fleet", str(tmp_path / "node0"), str(tmp_path / "node1"), str(other), "--json", "--no-cache"])
        == 0
    )
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["jobs"]) == 2
    assert out["problems"] == [
        f"{tmp_path / 'node1'}: the same job's books as {tmp_path / 'node0'} (one ledger URL and job id): counted once"
    ]


def test_serve_says_a_ledgers_damage_once_not_at_every_scrape(runs, caplog):
    # A job accounted from its events finds its damaged rows anew on each read: an exporter scraped every
    # 15 s printed `skipped N unreadable ledger records` 5,760 times a day per damaged job.
    import logging
    import sqlite3
    from argparse import Namespace

    from ettr.fleet.serve import loader
    from ettr.ledger.locate import ledger_path

    with contextlib.closing(sqlite3.connect(ledger_path(runs / "a1"))) as conn, conn:
        conn.execute(
            "INSERT INTO events (ts, kind, attempt, rank, step) VALUES (?, 'step', 0, 0, 7)", (-1.0,)
        )
    # A shared ledger's jobs are read from their events at each scrape (run directories are cached).
    url = f"sqlite:///{ledger_path(runs / 'a1')}"
    args = Namespace(run_dirs=[], ledger=url, workers=1, no_cache=True, cache_dir=None,
                     from_events=False, window=None)  # fmt: skip
    load = loader(args)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        for _ in range(3):
            jobs, problems = load(time.time())
            assert len(jobs) == 1 and problems == []
    said = [r.getMessage() for r in caplog.records if "unreadable ledger records" in r.getMessage()]
    assert len(said) == 1 and "skipped 1 unreadable" in said[0]
