"""`ettr report RUN_DIR --tensorboard DIR`: the report's figures as TensorBoard scalars, read back with
TensorBoard's own `EventAccumulator` and compared with the JSON report of the same run directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ettr.accounting import EttReport, compute
from ettr.cli import main
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Phase
from ettr.ledger import open_ledger
from ettr.report.json import to_dict
from ettr.report.tensorboard import run_logdirs, scalars, write_tensorboard

pytest.importorskip("tensorboard")

T0 = 1_700_000_000.0
K = EventKind


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall_time)] of every scalar in `logdir`, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value, s.wall_time) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def sup(kind: EventKind, t: float, attempt: int = 0, **data: Any) -> Event:
    return Event(kind, T0 + t, attempt, SUPERVISOR_RANK, data=data or None)


def job_events(job_id: str = "tb-job", *, crash_at: float = 14.0) -> list[Event]:
    """Attempt 0 trains steps 1..10, checkpoints step 6, crashes; attempt 1 resumes from 6 and completes."""
    ev = [sup(K.JOB_ALLOCATED, 0), sup(K.SUPERVISOR_START, 1, job_id=job_id), sup(K.ATTEMPT_START, 2)]
    ev += [Event(K.PHASE_BEGIN, T0 + 2, 0, 0, phase=Phase.COMPILE)]
    ev += [Event(K.PHASE_END, T0 + 3, 0, 0, phase=Phase.COMPILE, value=T0 + 2)]
    ev += [Event(K.STEP, T0 + 4 + i, 0, 0, step=i + 1) for i in range(10)]
    ev += [Event(K.PHASE_END, T0 + 9.8, 0, 0, phase=Phase.CHECKPOINT_BLOCKING, value=T0 + 9.5)]
    ev += [Event(K.CHECKPOINT_COMMIT, T0 + 9.8, 0, 0, step=6, data={"path": "/c/6"})]
    ev += [sup(K.ATTEMPT_END, crash_at, outcome="failed", exit_code=1)]
    ev += [sup(K.ATTEMPT_START, crash_at + 2, 1), Event(K.RESUMED, T0 + crash_at + 3, 1, 0, step=6)]
    ev += [Event(K.STEP, T0 + crash_at + 4 + i, 1, 0, step=7 + i) for i in range(10)]
    end = crash_at + 16
    ev += [
        sup(K.ATTEMPT_END, end, 1, outcome="completed", exit_code=0),
        sup(K.JOB_END, end + 1, 1, exit_status=0),
    ]
    return ev


def report_of(events: list[Event], job_id: str = "tb-job") -> EttReport:
    return compute(events, max(e.ts for e in events), job_id=job_id)


def assert_matches_report(values: dict[str, list[tuple[int, float, float]]], d: dict[str, Any]) -> None:
    """The scalars equal the `ettr.report/1` object `d` (float32 precision: TensorBoard stores floats)."""

    def last(tag: str) -> float:
        return values[tag][-1][1]

    def approx(x: float) -> Any:
        return pytest.approx(x, rel=1e-6, abs=1e-6)

    job_step = max(a["last_step"] for a in d["attempts"] if a["last_step"] is not None)
    assert values["goodput/goodput"] == [(job_step, approx(d["ett_pct"]), approx(d["wall_end_ts"]))]
    assert last("ettr/idleness_pct") == approx(d["idleness_pct"])
    assert last("ettr/failure_pct") == approx(d["failure_pct"])
    assert last("ettr/wall_s") == approx(d["wall_s"])
    assert last("ettr/effective_training_s") == approx(d["effective_training_s"])
    assert last("ettr/num_failures") == d["num_failures"]
    assert last("ettr/tts_s") == approx(d["tts_s"])
    assert [v for _s, v, _w in values["ettr/ttr_s"]] == approx(d["ttr_s"])
    assert [s for s, _v, _w in values["ettr/ttr_s"]] == list(range(1, len(d["ttr_s"]) + 1))
    assert last("ettr/mean_ttr_s") == approx(sum(d["ttr_s"]) / len(d["ttr_s"]))
    for bucket, seconds in d["buckets_s"].items():
        assert last(f"ettr/buckets_s/{bucket}") == approx(seconds), bucket
        if bucket != "effective_training":
            assert last(f"badput/{bucket}") == approx(seconds / d["wall_s"] * 100.0), bucket
    assert "badput/effective_training" not in values
    attempts = d["attempts"]
    assert [s for s, _v, _w in values["ettr/attempt/duration_s"]] == [a["index"] for a in attempts]
    assert [v for _s, v, _w in values["ettr/attempt/duration_s"]] == approx(
        [a["end_ts"] - a["start_ts"] for a in attempts]
    )
    assert [w for _s, _v, w in values["ettr/attempt/duration_s"]] == approx([a["end_ts"] for a in attempts])
    assert [v for _s, v, _w in values["ettr/attempt/lost_steps"]] == [a["lost_steps"] for a in attempts]
    assert [v for _s, v, _w in values["ettr/attempt/last_step"]] == [a["last_step"] for a in attempts]
    resumed = [(a["index"], a["resumed_from_step"]) for a in attempts if a["resumed_from_step"] is not None]
    assert [(s, v) for s, v, _w in values["ettr/attempt/resumed_from_step"]] == resumed
    for bucket in d["buckets_s"]:
        got = [v for _s, v, _w in values[f"ettr/attempt/buckets_s/{bucket}"]]
        assert got == approx([a["buckets_s"][bucket] for a in attempts]), bucket
    shares = [sum(a["buckets_s"].values()) for a in attempts]
    assert [v for _s, v, _w in values["ettr/attempt/ett_pct"]] == approx(
        [a["buckets_s"]["effective_training"] / s * 100 for a, s in zip(attempts, shares, strict=True)]
    )


def test_scalars_read_back_equal_the_json_report(tmp_path: Path) -> None:
    report = report_of(job_events())
    written = write_tensorboard(report, tmp_path / "tb")
    assert written.parent == tmp_path / "tb" and "tfevents" in written.name
    d = to_dict(report)
    assert d["num_failures"] == 1 and d["ttr_s"] and d["attempts"][0]["lost_steps"] == 4
    assert_matches_report(read_scalars(tmp_path / "tb"), d)


def test_every_scalar_has_one_point_per_step_and_the_tags_follow_the_goodput_scheme() -> None:
    points = scalars(report_of(job_events()))
    seen = {(p.tag, p.step) for p in points}
    assert len(seen) == len(points)  # TensorBoard would keep only one of two points at a step
    tags = {p.tag for p in points}
    assert "goodput/goodput" in tags
    assert {f"badput/{b.value}" for b in Bucket if b is not Bucket.EFFECTIVE_TRAINING} <= tags
    assert all(t.split("/")[0] in {"goodput", "badput", "ettr"} for t in tags)


def test_a_second_export_replaces_its_file(tmp_path: Path) -> None:
    first = write_tensorboard(report_of(job_events()), tmp_path)
    second = write_tensorboard(report_of(job_events(crash_at=15.0)), tmp_path)
    assert first == second and [p.name for p in tmp_path.iterdir()] == [first.name]
    values = read_scalars(tmp_path)
    assert_matches_report(values, to_dict(report_of(job_events(crash_at=15.0))))


def test_an_unknown_tts_or_no_recovery_writes_no_made_up_value(tmp_path: Path) -> None:
    events = [sup(K.SUPERVISOR_START, 0), sup(K.ATTEMPT_START, 1)]
    events += [sup(K.ATTEMPT_END, 5, outcome="failed", exit_code=1), sup(K.JOB_END, 6, exit_status=1)]
    report = report_of(events)
    assert report.tts_s is None and not report.ttr_s
    write_tensorboard(report, tmp_path)
    values = read_scalars(tmp_path)
    assert "ettr/tts_s" not in values and "ettr/ttr_s" not in values and "ettr/mean_ttr_s" not in values
    assert "ettr/attempt/last_step" not in values
    # no process of the job reported (only the supervisor's events): its ETT is unknown too, so no goodput
    assert report.ett_unknown is not None and "goodput/goodput" not in values


def test_run_logdirs_one_run_in_dir_several_in_unique_subdirs(tmp_path: Path) -> None:
    assert run_logdirs(tmp_path, ["a"]) == [tmp_path]
    # Labels come from report.labels.run_labels: "a/job" is a nested run; odd characters become "_".
    assert run_logdirs(tmp_path, ["a", "b/job", "c d/job", "a"]) == [
        tmp_path / "a",
        tmp_path / "b" / "job",
        tmp_path / "c_d" / "job",
        tmp_path / "a-2",
    ]


def test_unwritable_logdir_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="cannot write the TensorBoard scalars"):
        write_tensorboard(report_of(job_events()), tmp_path / "file" / "tb")


def _run_dir(tmp_path: Path, name: str, events: list[Event]) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    ledger = open_ledger(run_dir, create=True)
    try:
        ledger.append(events)
    finally:
        ledger.close()
    return run_dir


def test_cli_several_run_dirs_make_one_tensorboard_run_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _run_dir(tmp_path, "baseline", job_events("job-a"))
    b = _run_dir(tmp_path, "optimized", job_events("job-b", crash_at=12.0))
    tb = tmp_path / "tb"
    assert main(["report", str(a), str(b), "--json", "--tensorboard", str(tb)]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in tb.iterdir()) == ["baseline", "optimized"]
    for name, d in zip(["baseline", "optimized"], reports, strict=True):
        assert_matches_report(read_scalars(tb / name), d)


def test_a_run_dir_that_cannot_be_read_leaves_the_others_where_they_always_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `ettr report A B --tensorboard DIR` with B unreadable wrote A's events into DIR itself, and a later
    # run with both put them in DIR/A and DIR/B: two layouts mixed in one logdir.
    a = _run_dir(tmp_path, "baseline", job_events("job-a"))
    broken = tmp_path / "optimized"
    broken.mkdir()
    (broken / "ledger.db").write_bytes(b"not a database" * 100)
    tb = tmp_path / "tb"
    assert main(["report", str(a), str(broken), "--tensorboard", str(tb)]) == 2
    assert "skipped" in capsys.readouterr().err
    assert [p.name for p in tb.iterdir()] == ["baseline"]
    assert read_scalars(tb / "baseline")


def test_a_ledgers_jobs_are_named_by_their_job_ids(tmp_path: Path) -> None:
    from ettr.report.tensorboard import write_runs

    files = write_runs([report_of(job_events(), "job-a"), report_of(job_events(), "job-b")], [], tmp_path)
    assert sorted(f.parent.name for f in files) == ["job-a", "job-b"]


def test_cli_without_tensorboard_installed_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _run_dir(tmp_path, "run", job_events())
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    assert main(["report", str(run_dir), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs the tensorboard package" in err
    assert not (tmp_path / "tb").exists()
