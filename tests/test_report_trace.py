"""`ettr report RUN_DIR --trace FILE`: the Chrome/Perfetto trace of one job.

The perfetto package's trace processor downloads its binary on first use (not possible here), so every
trace is checked by a strict schema check of the JSON trace-event format (`check_trace`): required keys per
phase type, integer-or-float microsecond `ts` >= 0, timestamps monotonic per track, complete events with
`dur >= 0` properly nested on their track, B/E balanced, a name for every process and thread used. The
content is checked against the report the same events give: the bucket track adds up to the buckets, the
attempt spans are the report's attempts, the step counter is the STEP events.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ettr.accounting import EttReport, compute
from ettr.cli import main
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Phase
from ettr.ledger import open_ledger
from ettr.report.trace import PID_ACCOUNTING, PID_RANK_BASE, PID_SUPERVISOR, _lanes, to_trace, write_trace

T0 = 1_700_000_000.0
K = EventKind
_NEEDS_TS = {"X", "B", "E", "i", "I", "C"}
_METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace(trace: Any) -> None:
    """Raise AssertionError unless `trace` is a well-formed JSON trace-event object (what Perfetto's and
    chrome://tracing's JSON importers accept, held to the stricter rules they tolerate breaking)."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list), "no traceEvents list"
    assert trace.get("displayTimeUnit", "ms") in {"ms", "ns"}
    json.dumps(trace, allow_nan=False)  # strict JSON: no NaN/Infinity, plain types only
    named_processes: set[int] = set()
    named_threads: set[tuple[int, int]] = set()
    used_threads: set[tuple[int, int]] = set()
    last_ts: dict[tuple[Any, ...], float] = {}
    open_x: dict[tuple[int, int], list[float]] = defaultdict(list)  # ends of enclosing X events
    open_b: dict[tuple[int, int], list[str]] = defaultdict(list)
    for ev in trace["traceEvents"]:
        assert isinstance(ev, dict), ev
        ph = ev.get("ph")
        assert ph in _NEEDS_TS | {"M"}, f"unexpected phase type {ph!r}"
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        assert type(ev.get("pid")) is int and type(ev.get("tid")) is int, ev
        assert isinstance(ev.get("args", {}), dict), ev
        track = (ev["pid"], ev["tid"])
        if ph == "M":
            assert ev["name"] in _METADATA, ev
            if ev["name"].endswith("_name"):
                assert isinstance(ev["args"].get("name"), str) and ev["args"]["name"], ev
                (named_processes.add(ev["pid"]) if ev["name"] == "process_name" else named_threads.add(track))
            else:
                assert type(ev["args"].get("sort_index")) is int, ev
            continue
        ts = ev.get("ts")
        assert type(ts) in (int, float) and math.isfinite(ts) and ts >= 0, f"bad ts in {ev}"
        key = (ev["pid"], ev["name"]) if ph == "C" else track  # counters are per process and name
        assert ts >= last_ts.get(key, -1.0), f"ts goes backwards on {key}: {ev}"
        last_ts[key] = ts
        if ph == "C":
            assert ev["args"] and all(type(v) in (int, float) for v in ev["args"].values()), ev
            continue
        used_threads.add(track)
        stack = open_x[track]
        while stack and stack[-1] <= ts:
            stack.pop()
        if ph == "X":
            dur = ev.get("dur")
            assert type(dur) in (int, float) and math.isfinite(dur) and dur >= 0, f"bad dur in {ev}"
            assert not stack or ts + dur <= stack[-1], f"X event overlaps its enclosing one: {ev}"
            stack.append(ts + dur)
        elif ph in ("i", "I"):
            assert ev.get("s", "t") in {"g", "p", "t"}, ev
        elif ph == "B":
            open_b[track].append(ev["name"])
        else:
            assert open_b[track], f"E without B: {ev}"
            open_b[track].pop()
    assert not any(open_b.values()), "unbalanced B/E"
    pids = {p for p, _t in used_threads} | {k[0] for k in last_ts}
    assert pids <= named_processes, f"unnamed processes {pids - named_processes}"
    assert used_threads <= named_threads, f"unnamed threads {used_threads - named_threads}"


# -- the check itself fails on broken traces ------------------------------------------------------------
def _named(*events: dict[str, Any]) -> dict[str, Any]:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "p"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}},
    ]
    return {"traceEvents": meta + list(events)}


def _x(ts: float, dur: float, **extra: Any) -> dict[str, Any]:
    return {"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": ts, "dur": dur, **extra}


@pytest.mark.parametrize(
    "trace",
    [
        _named(_x(0, 10), _x(5, 10)),  # partial overlap on one track
        _named(_x(10, 1), _x(5, 1)),  # backwards in time
        _named(_x(0, -1)),  # negative duration
        _named(_x(-5, 1)),  # before the origin
        _named({"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": 0}),  # no dur
        _named({"ph": "B", "name": "b", "pid": 1, "tid": 1, "ts": 0}),  # never ended
        _named({"ph": "E", "name": "e", "pid": 1, "tid": 1, "ts": 0}),  # never begun
        _named({"ph": "X", "name": "x", "pid": 1, "tid": 2, "ts": 0, "dur": 1}),  # unnamed thread
        _named({"ph": "i", "name": "i", "pid": 1, "tid": 1, "ts": 0, "s": "q"}),  # bad scope
        _named({"ph": "C", "name": "c", "pid": 1, "tid": 0, "ts": 0, "args": {"v": "1"}}),  # non-number
        _named(_x(float("nan"), 1)),
    ],
)
def test_the_check_rejects_broken_traces(trace: dict[str, Any]) -> None:
    with pytest.raises((AssertionError, ValueError)):
        check_trace(trace)


def test_the_check_accepts_nesting_and_adjacency() -> None:
    check_trace(_named(_x(0, 10), _x(0, 4), _x(4, 6), _x(10, 5), _x(15, 0)))


# -- a job told as events -------------------------------------------------------------------------------
def sup(kind: EventKind, t: float, attempt: int = 0, **data: Any) -> Event:
    return Event(kind, T0 + t, attempt, SUPERVISOR_RANK, data=data or None)


def span(phase: Phase, t: float, dur: float, attempt: int = 0, rank: int = 0) -> list[Event]:
    return [
        Event(K.PHASE_BEGIN, T0 + t, attempt, rank, phase=phase),
        Event(K.PHASE_END, T0 + t + dur, attempt, rank, phase=phase, value=T0 + t),
    ]


def job_events(*, killed_supervisor: bool = False) -> list[Event]:
    """Two ranks. Attempt 0: compile overlapping the first batch, steps 1..10 with a checkpoint (blocking,
    then an overlapped persist) at 5, crash at 14.3. Attempt 1 resumes from 5 and completes (or, with
    `killed_supervisor`, is left open with a phase that never ended, as a SIGKILL leaves it)."""
    ev = [sup(K.JOB_SUBMITTED, 0), sup(K.JOB_ALLOCATED, 1), sup(K.SUPERVISOR_START, 2, job_id="trace-job")]
    ev += [sup(K.ATTEMPT_START, 2.5)]
    for rank in (0, 1):
        ev += [Event(K.PROCESS_START, T0 + 2.6, 0, rank, data={"pid": 10 + rank, "world_size": 2})]
        ev += span(Phase.PROCESS_GROUP_INIT, 2.7, 0.3, rank=rank)
        ev += span(Phase.COMPILE, 3.0, 1.5, rank=rank)
        ev += span(Phase.DATA_WAIT, 4.0, 1.0, rank=rank)  # overlaps compile: needs a second lane
        ev += [Event(K.STEP, T0 + 5 + n * 0.8, 0, rank, step=n) for n in range(1, 11)]
        ev += span(Phase.CHECKPOINT_BLOCKING, 9.0, 0.2, rank=rank)
        ev += span(Phase.CHECKPOINT_PERSIST, 9.2, 2.0, rank=rank)
    ev += [Event(K.CHECKPOINT_COMMIT, T0 + 11.2, 0, 0, step=5, data={"path": "ckpt/5"})]
    ev += [Event(K.FAILURE, T0 + 14.2, 0, 1, data={"exception": "RuntimeError", "message": "boom"})]
    ev += [sup(K.ATTEMPT_END, 14.3, outcome="failed", exit_code=1)]
    ev += [sup(K.ATTEMPT_START, 16, 1)]
    for rank in (0, 1):
        ev += span(Phase.RESTORE, 16.5, 1.0, attempt=1, rank=rank)
        ev += [Event(K.RESUMED, T0 + 17.5, 1, rank, step=5)]
        ev += [Event(K.STEP, T0 + 18 + n * 0.8, 1, rank, step=5 + n) for n in range(1, 11)]
    if killed_supervisor:
        ev += [Event(K.PHASE_BEGIN, T0 + 26.5, 1, 0, phase=Phase.SHUTDOWN)]
        ev += [Event(K.MARK, T0 + 27.0, 1, 0, data={"name": "last words"})]
        return ev
    ev += span(Phase.SHUTDOWN, 26.5, 1.0, attempt=1)
    ev += [
        sup(K.ATTEMPT_END, 28, 1, outcome="completed", exit_code=0),
        sup(K.JOB_END, 28.5, 1, exit_status=0),
    ]
    return ev


def report_of(events: list[Event]) -> EttReport:
    return compute(events, max(e.ts for e in events), job_id="trace-job")


def _by(trace: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def _names(trace: dict[str, Any], kind: str) -> dict[tuple[int, int] | int, str]:
    out: dict[tuple[int, int] | int, str] = {}
    for e in _by(trace, ph="M", name=kind):
        out[e["pid"] if kind == "process_name" else (e["pid"], e["tid"])] = e["args"]["name"]
    return out


@pytest.mark.parametrize("killed", [False, True])
def test_trace_is_well_formed_with_a_track_per_rank_and_the_supervisor(killed: bool) -> None:
    events = job_events(killed_supervisor=killed)
    trace = to_trace(events, report_of(events))
    check_trace(trace)
    check_trace(json.loads(json.dumps(trace)))
    processes = _names(trace, "process_name")
    assert processes[PID_SUPERVISOR] == "supervisor"
    assert processes[PID_RANK_BASE] == "rank 0" and processes[PID_RANK_BASE + 1] == "rank 1"
    assert processes[PID_ACCOUNTING].startswith("ETT accounting")
    assert set(processes) == {PID_ACCOUNTING, PID_SUPERVISOR, PID_RANK_BASE, PID_RANK_BASE + 1}
    assert trace["otherData"]["schema"] == "ettr.trace/1" and trace["otherData"]["ranks"] == [0, 1]
    assert trace["otherData"]["origin_unix_s"] == T0


def test_bucket_track_adds_up_to_the_reports_buckets_and_ett() -> None:
    events = job_events()
    report = report_of(events)
    trace = to_trace(events, report)
    totals: dict[str, float] = defaultdict(float)
    for e in _by(trace, ph="X", cat="bucket"):
        totals[e["name"]] += e["dur"] / 1e6
    for bucket in Bucket:
        assert totals.get(bucket.value, 0.0) == pytest.approx(report.buckets_s[bucket], abs=1e-5), bucket
    assert sum(totals.values()) == pytest.approx(report.wall_s, abs=1e-5)
    assert {e["args"]["counts_as"] for e in _by(trace, ph="X", cat="bucket", name="wasted_progress")} == {
        "failure"
    }
    ett = _by(trace, ph="C", name="ETT % so far")
    assert ett[-1]["args"]["effective_training_pct"] == pytest.approx(report.ett_pct)
    (tts,) = _by(trace, ph="X", name="TTS")
    assert tts["dur"] / 1e6 == pytest.approx(report.tts_s, abs=1e-5)
    ttrs = [e for e in _by(trace, ph="X", cat="window") if e["name"].startswith("TTR")]
    assert [e["dur"] / 1e6 for e in ttrs] == pytest.approx(list(report.ttr_s), abs=1e-5)


@pytest.mark.parametrize("killed", [False, True])
def test_attempt_spans_are_the_reports_attempts(killed: bool) -> None:
    events = job_events(killed_supervisor=killed)
    report = report_of(events)
    trace = to_trace(events, report)
    spans = _by(trace, ph="X", cat="attempt", pid=PID_SUPERVISOR)
    assert len(spans) == len(report.attempts) == 2
    for span_ev, a in zip(spans, report.attempts, strict=True):
        assert span_ev["ts"] == round((a.start_ts - T0) * 1e6)
        assert span_ev["ts"] + span_ev["dur"] == round((a.end_ts - T0) * 1e6)
        args = span_ev["args"]
        assert (args["outcome"], args["resumed_from_step"], args["last_step"], args["lost_steps"]) == (
            a.outcome.value,
            a.resumed_from_step,
            a.last_step,
            a.lost_steps,
        )
        assert args["closed_by_accounting"] is a.closed_by_accounting
    assert spans[1]["args"]["closed_by_accounting"] is killed
    sup_instants = _by(trace, ph="i", pid=PID_SUPERVISOR)
    assert len(sup_instants) == sum(e.rank == SUPERVISOR_RANK for e in events)
    assert any(e["name"] == "attempt 0 end: failed (exit 1)" for e in sup_instants)


def test_rank_tracks_hold_phases_steps_commits_and_failures() -> None:
    events = job_events(killed_supervisor=True)
    report = report_of(events)
    trace = to_trace(events, report)
    for rank in (0, 1):
        pid = PID_RANK_BASE + rank
        steps = [e["args"]["step"] for e in _by(trace, ph="C", pid=pid, name="global step")]
        assert steps == [e.step for e in events if e.kind is K.STEP and e.rank == rank]
        phases = _by(trace, ph="X", cat="phase", pid=pid)
        by_name = defaultdict(list)
        for p in phases:
            by_name[p["name"]].append(p)
        assert by_name["compile"][0]["tid"] != by_name["data_wait"][0]["tid"]  # they overlap
        assert by_name["checkpoint_persist"][0]["args"]["bucket"] == "none (raw duration only)"
        assert by_name["restore"][0]["args"] == {"attempt": 1, "bucket": "restore"}
    # The SHUTDOWN phase never ended: closed at the attempt's end (as the accounting closes it).
    (shutdown,) = _by(trace, ph="X", cat="phase", pid=PID_RANK_BASE, name="shutdown")
    assert shutdown["ts"] + shutdown["dur"] == round((report.attempts[1].end_ts - T0) * 1e6)
    names = {e["name"] for e in _by(trace, ph="i", pid=PID_RANK_BASE)}
    assert {"process start", "checkpoint commit (step 5)", "resumed from step 5", "mark: last words"} <= names
    (failure,) = _by(trace, ph="i", pid=PID_RANK_BASE + 1, name="failure")
    assert failure["args"]["message"] == "boom" and failure["args"]["attempt"] == 0


def test_odd_event_data_becomes_plain_json() -> None:
    events = job_events()
    events.append(Event(K.MARK, T0 + 6, 0, 0, data={"name": "odd", "x": math.nan, "obj": object()}))
    events.append(Event(K.MARK, math.nan, 0, 0, data={"name": "no time"}))  # left out, as the accounting does
    trace = to_trace(events, report_of(events))
    check_trace(trace)
    (mark,) = _by(trace, ph="i", name="mark: odd")
    assert mark["args"]["x"] is None and isinstance(mark["args"]["obj"], str)
    assert not _by(trace, name="mark: no time")


def test_failures_before_any_training_nest_their_windows() -> None:
    """Attempts 0 and 1 die in start-up; attempt 2 trains: the TTS and both TTR windows end together."""
    ev = [sup(K.JOB_ALLOCATED, 0), sup(K.SUPERVISOR_START, 1)]
    for attempt, start in ((0, 2.0), (1, 6.0)):
        ev += [sup(K.ATTEMPT_START, start, attempt), *span(Phase.INIT, start + 0.5, 2.0, attempt=attempt)]
        ev += [sup(K.ATTEMPT_END, start + 3.0, attempt, outcome="failed", exit_code=1)]
    ev += [sup(K.ATTEMPT_START, 10, 2), *span(Phase.INIT, 10.5, 1.0, attempt=2)]
    ev += [Event(K.STEP, T0 + 12 + n, 2, 0, step=n) for n in range(1, 6)]
    ev += [
        sup(K.ATTEMPT_END, 17, 2, outcome="completed", exit_code=0),
        sup(K.JOB_END, 17.5, 2, exit_status=0),
    ]
    report = report_of(ev)
    trace = to_trace(ev, report)
    check_trace(trace)
    windows = _by(trace, ph="X", cat="window")
    assert sorted(w["dur"] / 1e6 for w in windows) == pytest.approx(sorted([report.tts_s, *report.ttr_s]))
    assert len(windows) == 1 + len(report.ttr_s) and len({w["ts"] + w["dur"] for w in windows}) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=30))
def test_lanes_never_partly_overlap(raw: list[tuple[int, int]]) -> None:
    spans = sorted(((b, b + d) for b, d in raw), key=lambda s: (s[0], -s[1]))
    lanes = _lanes(spans)
    events = [
        {"ph": "X", "name": "p", "pid": 1, "tid": lane, "ts": b, "dur": e - b}
        for (b, e), lane in zip(spans, lanes, strict=True)
    ]
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "p"}}]
    meta += [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": n, "args": {"name": "t"}} for n in set(lanes)
    ]
    check_trace({"traceEvents": meta + events})
    # Never more lanes than the deepest pile of spans open at one instant.
    depth = max((sum(b <= t < e for b, e in spans) for t in range(71)), default=0)
    assert len(set(lanes)) <= max(depth, 1 if spans else 0)


# -- the file and the command ---------------------------------------------------------------------------
def test_write_trace_commits_a_whole_file_and_says_when_it_cannot(tmp_path: Path) -> None:
    events = job_events()
    target = tmp_path / "job.trace.json"
    write_trace(events, report_of(events), target)
    check_trace(json.loads(target.read_text()))
    assert [p.name for p in tmp_path.iterdir()] == ["job.trace.json"]  # no temporary left beside it
    with pytest.raises(UsageError, match="cannot write the trace"):
        write_trace(events, report_of(events), tmp_path / "missing" / "x.json")


def _run_dir(tmp_path: Path, name: str, events: list[Event]) -> Path:
    run_dir = tmp_path / name
    run_dir.mkdir()
    ledger = open_ledger(run_dir, create=True)
    try:
        ledger.append(events)
    finally:
        ledger.close()
    return run_dir


def test_cli_trace_of_a_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run_dir(tmp_path, "run", job_events())
    out = tmp_path / "t.json"
    assert main(["report", str(run_dir), "--json", "--trace", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    trace = json.loads(out.read_text())
    check_trace(trace)
    assert trace["otherData"]["job_id"] == report["job_id"] == "trace-job"
    assert trace["otherData"]["ett_pct"] == pytest.approx(report["ett_pct"])


def test_cli_trace_refuses_several_run_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _run_dir(tmp_path, "a", job_events()), _run_dir(tmp_path, "b", job_events())
    assert main(["report", str(a), str(b), "--trace", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--trace takes one RUN_DIR" in err
    assert not (tmp_path / "t.json").exists()


# -- a real job -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_ettr_run_job_exports_a_trace_and_tensorboard_scalars(tmp_path: Path) -> None:
    """`ettr run` a plain script with a crash at step 7, then export both: the trace is well formed and
    matches the JSON report; the TensorBoard scalars read back equal it."""
    script = Path(__file__).parent / "scripts" / "train_plain.py"
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    ettr = [sys.executable, "-m", "ettr.cli"]
    command = [sys.executable, str(script), "--ckpt-dir", str(tmp_path / "ckpt"), "--num-steps", "12"]
    command += ["--save-every", "5", "--step-s", "0.05", "--first-batch-s", "0.1", "--init-s", "0.1"]
    done = subprocess.run(
        [*ettr, "run", "--run-dir", str(run_dir), "--inject", "crash@step=7", "--", *command],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trace_file, tb_dir = tmp_path / "job.trace.json", tmp_path / "tb"
    done = subprocess.run(
        [*ettr, "report", str(run_dir), "--json", "--trace", str(trace_file), "--tensorboard", str(tb_dir)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    trace = json.loads(trace_file.read_text())
    check_trace(trace)
    spans = _by(trace, ph="X", cat="attempt")
    assert [(s["args"]["outcome"], s["args"]["resumed_from_step"]) for s in spans] == [
        (a["outcome"], a["resumed_from_step"]) for a in report["attempts"]
    ]
    assert [a["outcome"] for a in report["attempts"]] == ["failed", "completed"]
    totals: dict[str, float] = defaultdict(float)
    for e in _by(trace, ph="X", cat="bucket"):
        totals[e["name"]] += e["dur"] / 1e6
    for bucket, seconds in report["buckets_s"].items():
        assert totals.get(bucket, 0.0) == pytest.approx(seconds, abs=1e-4), bucket
    steps = [e["args"]["step"] for e in _by(trace, ph="C", pid=PID_RANK_BASE, name="global step")]
    assert max(steps) == report["attempts"][-1]["last_step"] == 12
    assert any(e["name"].startswith("checkpoint commit") for e in _by(trace, ph="i", pid=PID_RANK_BASE))
    pytest.importorskip("tensorboard")
    from test_report_tensorboard import read_scalars

    values = read_scalars(tb_dir)
    assert values["goodput/goodput"][-1][1] == pytest.approx(report["ett_pct"], rel=1e-6)
    for bucket, seconds in report["buckets_s"].items():
        assert values[f"ettr/buckets_s/{bucket}"][-1][1] == pytest.approx(seconds, rel=1e-6, abs=1e-6)


def test_cli_trace_refuses_several_jobs_of_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Several --job-id wrote the first job's trace alone and said nothing of the others.
    url = f"sqlite:///{tmp_path / 'books.db'}"
    argv = ["report", "--ledger", url, "--job-id", "a", "--job-id", "b", "--trace", str(tmp_path / "t.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--trace takes one RUN_DIR or --job-id" in err
    assert not (tmp_path / "t.json").exists()
