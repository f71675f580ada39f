"""ettr serve: a real scrape of /metrics on a loopback port, parsed with prometheus-client's own parser,
equals `ettr fleet --json` number for number; labels stay within job, family, bucket, cause."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ettr.cli import main
from ettr.testing.fleet import JobSpec, write_job

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def runs(tmp_path):
    for i in range(5):
        spec = JobSpec(job_id=f"j{i}", family="alpha" if i < 3 else "beta", start_ts=T0 + i * 500,
                       world_size=1 + i % 2, fail_at_steps=(40,) if i == 1 else (), failure_kind="infra")  # fmt: skip
        write_job(tmp_path / f"j{i}", spec)
    write_job(tmp_path / "u", JobSpec(job_id="u", family="beta", start_ts=T0 + 3000, fail_at_steps=(10,)))
    return tmp_path


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_scrape_parses_and_equals_fleet_json(runs, capsys):
    from ettr.fleet.serve import loader, start_server

    assert main(["fleet", str(runs), "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)
    args = argparse.Namespace(run_dirs=[str(runs)], ledger=None, workers=1, no_cache=True)
    server = start_server(loader(args), port=0, addr="127.0.0.1")
    try:
        samples = _scrape(server.port)
        again = _scrape(server.port)  # the second scrape comes from the cache of finished jobs
    finally:
        server.close()
    assert {k: [(s.labels, s.value) for s in v] for k, v in samples.items()} == {
        k: [(s.labels, s.value) for s in v] for k, v in again.items()
    }
    allowed = {"job", "job_id", "family", "name", "bucket", "cause", "detail"}  # closed sets: bounded series
    for name, rows in samples.items():
        for s in rows:
            assert set(s.labels) <= (allowed | {"version"} if name == "ettr_build_info" else allowed), name
            # Prometheus renames `job` (its own target label) to `exported_job`: each job's id is `job_id` too
            assert s.labels.get("job_id") == s.labels.get("job"), name

    def by_job(name: str, **match) -> dict[str, float]:
        rows = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in match.items())]
        return {s.labels["job"]: s.value for s in rows}

    jobs = {j["job_id"]: j for j in fleet["jobs"]}
    assert samples["ettr_fleet_effective_training_ratio"][0].value == pytest.approx(
        fleet["ett_pct"] / 100, rel=1e-12
    )
    assert by_job("ettr_effective_training_ratio") == pytest.approx(
        {k: j["ett_pct"] / 100 for k, j in jobs.items()}
    )
    assert by_job("ettr_gpus") == {k: j["gpus"] for k, j in jobs.items()}
    assert by_job("ettr_wall_seconds_total") == {k: j["wall_s"] for k, j in jobs.items()}
    for bucket in ("compile", "init", "effective_training", "wasted_progress", "checkpoint_blocking"):
        assert by_job("ettr_bucket_seconds_total", bucket=bucket) == {
            k: j["buckets_s"][bucket] for k, j in jobs.items()
        }
    assert by_job("ettr_time_to_start_seconds") == {k: j["tts_s"] for k, j in jobs.items()}
    for cause in ("infra", "user", "preemption", "hang", "unknown"):
        expected = {k: float(sum(f["cause"] == cause for f in j["failures"])) for k, j in jobs.items()}
        assert by_job("ettr_failures_total", cause=cause) == expected
    assert by_job("ettr_failures_total", cause="infra")["j1"] == 1.0
    assert by_job("ettr_restarts_total", cause="user")["u"] == 1.0
    assert {s.labels["family"]: s.value for s in samples["ettr_regressions"]} == {"alpha": 0.0, "beta": 0.0}
    assert samples["ettr_jobs"][0].value == len(jobs)
    fleet_buckets = {s.labels["bucket"]: s.value for s in samples["ettr_fleet_bucket_gpu_seconds_total"]}
    assert fleet_buckets == pytest.approx(
        {b: h * 3600 for b, h in fleet["bucket_gpu_hours"].items()}, rel=1e-12
    )
    fleet_failures = {s.labels["cause"]: s.value for s in samples["ettr_fleet_failures_total"]}
    assert fleet_failures == {c: float(n) for c, n in fleet["num_failures_by_cause"].items()}
    fleet_details = {s.labels["detail"]: s.value for s in samples["ettr_fleet_failures_by_detail_total"]}
    assert fleet_details == {d: float(n) for d, n in fleet["num_failures_by_detail"].items()}
    assert sum(fleet_details.values()) == sum(fleet_failures.values()) > 0
    assert samples["ettr_build_info"][0].value == 1.0


def test_running_jobs_export_unsaved_work_and_time_since_commit(tmp_path):
    from ettr.fleet.load import find_run_dirs, load_run_dirs
    from ettr.fleet.metrics import metric_families

    now = time.time()
    spec = JobSpec(job_id="r", running=True, host="elsewhere", num_steps=30, ckpt_every=20, start_ts=now - 60)
    write_job(tmp_path / "r", spec)
    jobs, problems = load_run_dirs(find_run_dirs([tmp_path]), now=now)
    assert not problems and jobs[0].running
    metrics = {m.name: m for m in metric_families(jobs, now)}
    since = metrics["ettr_time_since_last_commit_seconds"].samples[0].value
    unsaved = metrics["ettr_unsaved_work_seconds"].samples[0].value
    assert since == pytest.approx(now - jobs[0].last_commit_ts)
    assert unsaved == pytest.approx(since)  # it committed after it began training
    assert metrics["ettr_preemption_cost_gpu_seconds"].samples[0].value >= unsaved


def test_grafana_dashboard_queries_only_metrics_that_are_served(runs):
    import re

    from ettr.fleet.load import find_run_dirs, load_run_dirs
    from ettr.fleet.metrics import metric_families

    jobs, _ = load_run_dirs(find_run_dirs([runs]), now=T0)
    jobs = [*jobs, replace(jobs[0], job_id="live", running=True, in_progress=True, last_commit_ts=T0)]
    served = {s.name for m in metric_families(jobs, T0 + 10) for s in m.samples}
    dashboard = json.loads(
        (Path(__file__).parent.parent / "docs" / "grafana" / "ettr-fleet.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    used = {name for e in exprs for name in re.findall(r"\bettr_[a-z_]+", e)}
    assert used and used <= served, used - served
    # Prometheus sets `job` to the scrape config's job_name (ours becomes `exported_job` under the default
    # honor_labels: false): a join or legend on `job` alone sees one value for every ettr job.
    doc = (Path(__file__).parent.parent / "docs" / "fleet.md").read_text()
    for expr in [*exprs, *re.findall(r"`(sum by [^`]*group_left[^`]*)`", doc.replace("\n", " "))]:
        for clause in re.findall(r"\b(?:on|by|ignoring|without|group_left|group_right)\s*\(([^)]*)\)", expr):
            names = {n.strip() for n in clause.split(",")}
            assert "job" not in names or "job_id" in names, expr
    legends = [t.get("legendFormat", "") for p in dashboard["panels"] for t in p["targets"]]
    assert not [legend for legend in legends if "{{job}}" in legend], legends


def test_serve_gives_the_windowed_ett_and_the_fleet_lists_jobs_with_stragglers(tmp_path, capsys):
    """`ettr serve --window 600`: each job's ETT over its last 10 minutes beside the cumulative ratio; a job
    whose rank 1 straggled is listed by the fleet (from the summary stored at its end, which read every rank)
    and exported with the time it waited."""
    from ettr.fleet.serve import loader, start_server
    from ettr.fleet.stored import store_run_dir
    from ettr.ledger import open_ledger
    from test_stragglers import _two_hours
    from test_stragglers import job as rank_job

    for name, events in (("long", _two_hours()), ("slow", rank_job(slow={1: (101, 200, 0.05)}))):
        ledger = open_ledger(tmp_path / "runs" / name)
        ledger.append(events)
        ledger.close()
        assert store_run_dir(tmp_path / "runs" / name) is not None
    assert main(["fleet", str(tmp_path / "runs"), "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)
    (listed,) = fleet["jobs_with_stragglers"]
    assert listed["job_id"] == "slow" and listed["stragglers"][0].startswith("rank 1 (host h0) slower than")
    jobs = {j["job_id"]: j for j in fleet["jobs"]}
    assert jobs["long"]["stragglers"] is None  # one rank: nothing to compare
    assert jobs["long"]["window_s"] == 3600 and jobs["long"]["window_ett_pct"] == pytest.approx(1600 / 36)
    assert main(["fleet", str(tmp_path / "runs")]) == 0
    assert "jobs with stragglers (1; ranks not compared in 1 job(s))" in capsys.readouterr().out

    args = argparse.Namespace(
        run_dirs=[str(tmp_path / "runs")], ledger=None, workers=1, no_cache=True, window=600.0
    )
    server = start_server(loader(args), port=0, addr="127.0.0.1")
    try:
        samples = _scrape(server.port)
    finally:
        server.close()
    window = {s.labels["job"]: s.value for s in samples["ettr_window_effective_training_ratio"]}
    assert window["long"] == pytest.approx(1.0)  # its last 10 minutes trained
    assert samples["ettr_window_seconds"][0].value == 600
    assert {s.labels["job"]: s.value for s in samples["ettr_stragglers"]} == {"slow": 1.0}
    (waited,) = samples["ettr_straggler_wait_seconds_total"]
    assert waited.labels["job"] == "slow" and waited.value == pytest.approx(listed["lost_s"])


def test_series_that_the_books_revise_are_gauges_and_counters_only_grow(runs):
    """Prometheus takes a counter's drop for a restart and counts its whole new value as an increase. The
    seconds per bucket drop when a failure turns kept work into wasted work (a real 2-rank job's
    effective_training went 1.81 s -> 1.28 s between two scrapes; a requeue took `shutdown` 0.05 s -> 0), and
    fleet-wide sums drop when a job cannot be read: those are gauges (named as before); per-job failures,
    restarts and wall time stay counters."""
    from ettr.fleet.load import find_run_dirs, load_run_dirs
    from ettr.fleet.metrics import metric_families

    jobs, _ = load_run_dirs(find_run_dirs([runs]), now=T0)
    types = {m.name: m.type for m in metric_families(jobs, T0 + 10)}
    for name in (
        "ettr_bucket_seconds_total",
        "ettr_fleet_bucket_gpu_seconds_total",
        "ettr_fleet_failures_total",
        "ettr_fleet_failures_by_detail_total",
    ):
        assert types[name] == "gauge", name
    for name in ("ettr_wall_seconds", "ettr_failures", "ettr_restarts"):  # exposed with _total
        assert types[name] == "counter", name


def test_a_fleet_that_could_not_be_read_exports_no_fleet_sums(tmp_path):
    """A scrape while the ledger cannot be read (the server down) says so, and gives no job count and no
    fleet sums: 0 jobs and 0 failures were wrong numbers, and the next good scrape read as every failure
    of the fleet happening at once."""
    from ettr.fleet.serve import loader, start_server

    url = f"sqlite:///{tmp_path / 'gone' / 'ledger.db'}"
    args = argparse.Namespace(run_dirs=[], ledger=url, workers=1, no_cache=True)
    server = start_server(loader(args), port=0, addr="127.0.0.1")
    try:
        samples = _scrape(server.port)
    finally:
        server.close()
    assert samples["ettr_jobs_unreadable"][0].value == 1.0
    for name in (
        "ettr_jobs",
        "ettr_fleet_effective_training_ratio",
        "ettr_fleet_bucket_gpu_seconds_total",
        "ettr_fleet_failures_total",
        "ettr_fleet_failures_by_detail_total",
    ):
        assert name not in samples, name
    assert samples["ettr_build_info"][0].value == 1.0


def test_two_jobs_of_one_id_and_directory_name_never_share_a_label_set(tmp_path):
    """`ettr run --job-id exp1` in runs/teamA/exp1 and in runs/teamB/exp1: every series was in the exposition
    twice with the same labels, and Prometheus kept one of each pair (the other job vanished, its failure
    with it). Each is named by the tail of its path that tells them apart."""
    from ettr.fleet.load import find_run_dirs, load_run_dirs
    from ettr.fleet.metrics import metric_families

    write_job(tmp_path / "teamA" / "exp1", JobSpec(job_id="exp1", family="f", start_ts=T0, world_size=8))
    write_job(
        tmp_path / "teamB" / "exp1",
        JobSpec(job_id="exp1", family="f", start_ts=T0 + 900, world_size=2, fail_at_steps=(40,)),
    )
    write_job(tmp_path / "other", JobSpec(job_id="other", family="f", start_ts=T0 + 1800))
    jobs, problems = load_run_dirs(find_run_dirs([tmp_path]), now=T0 + 10_000)
    assert not problems and len(jobs) == 3
    for family in metric_families(jobs, T0 + 10_000):
        label_sets = [tuple(sorted(s.labels.items())) for s in family.samples]
        assert len(label_sets) == len(set(label_sets)), family.name
    (gpus,) = [m for m in metric_families(jobs, T0 + 10_000) if m.name == "ettr_gpus"]
    assert {s.labels["name"]: s.value for s in gpus.samples} == {
        "teamA/exp1": 8.0,
        "teamB/exp1": 2.0,
        "other": 1.0,
    }


def test_only_the_four_former_counters_are_gauges_named_total(runs):
    """`promtool check metrics` (Prometheus 2.42) on a real scrape names exactly these four gauges, kept under
    the names they had as counters (docs/fleet.md); a new gauge with `_total` would be a fifth."""
    from ettr.fleet.load import find_run_dirs, load_run_dirs
    from ettr.fleet.metrics import metric_families

    jobs, _ = load_run_dirs(find_run_dirs([runs]), now=T0)
    families = metric_families(jobs, T0 + 10)
    gauges_total = {m.name for m in families if m.type != "counter" and m.name.endswith("_total")}
    assert gauges_total == {
        "ettr_bucket_seconds_total",
        "ettr_fleet_bucket_gpu_seconds_total",
        "ettr_fleet_failures_total",
        "ettr_fleet_failures_by_detail_total",
    }
    assert all(m.type in ("counter", "gauge", "info") for m in families)


def test_a_read_slower_than_the_scrape_budget_serves_the_newest_complete_read(caplog):
    # A PostgreSQL ledger server under SIGSTOP made scrapes take 3.0-5.8 s: past a 5 s scrape timeout
    # Prometheus drops every series of the target. A read past the budget goes on in the background.
    import threading

    from ettr.fleet.serve import BoundedReads, start_server

    release = threading.Event()
    reads: list[float] = []

    def read(now):
        reads.append(now)
        if len(reads) > 1:
            release.wait(60)  # every read after the first stalls until released
        return [], [f"read {len(reads)}"]

    bounded = BoundedReads(read, budget_s=0.05)
    assert bounded(100.0) == ([], ["read 1"]) and bounded.served_age_s == 0.0  # the first is waited for
    assert bounded(130.0) == ([], ["read 1"])  # the second stalls: the newest complete read is served
    assert bounded.served_age_s == 30.0
    assert bounded(160.0) == ([], ["read 1"]) and reads == [100.0, 130.0]  # no second read beside it
    assert bounded.served_age_s == 60.0
    assert sum("takes over" in r.getMessage() for r in caplog.records) == 1  # said once
    release.set()
    for _ in range(200):  # the stalled read ends in the background; wait for it without a timing assert
        if bounded(190.0) != ([], ["read 1"]):
            break
        release.wait(0.05)
    assert bounded(220.0)[1][0].startswith("read ") and bounded.served_age_s == 0.0
    server = start_server(bounded, port=0, addr="127.0.0.1")
    try:
        assert _scrape(server.port)["ettr_serve_read_age_seconds"][0].value == 0.0
    finally:
        server.close()
