"""The renderers: `to_dict` is exactly the contract's `ettr.report/1`; text reports name every bucket."""

from __future__ import annotations

import json
import math
import re

import pytest

from ettr.accounting import EttReport, compute
from ettr.constants import SIGNALLED_MARK
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Phase
from ettr.report.html import render_html
from ettr.report.json import SCHEMA, to_dict
from ettr.report.text import render, render_comparison, summary_line

T0 = 1_700_000_000.0
K = EventKind
CONTRACT_KEYS = [
    "schema",
    "job_id",
    "wall_s",
    "ett_pct",
    "idleness_pct",
    "failure_pct",
    "tts_s",
    "ttr_s",
    "num_failures",
    "buckets_s",
    "attempts",
]
ATTEMPT_KEYS = [
    "index",
    "start_ts",
    "end_ts",
    "outcome",
    "exit_code",
    "resumed_from_step",
    "last_step",
    "lost_steps",
    "buckets_s",
]


def sup(kind: EventKind, t: float, attempt: int = 0, **data) -> Event:
    return Event(kind, T0 + t, attempt, SUPERVISOR_RANK, data=data or None)


def two_attempt_job(
    *, job_end: bool = True, alive: bool | None = None, stop_signal_at: float | None = None
) -> EttReport:
    """Attempt 0 trains steps 1..10 (2..11), crashes at 12; attempt 1 resumes step 6 and completes (with
    `stop_signal_at`: SIGTERM reached the supervisor then, in attempt 1)."""
    events = [sup(K.JOB_ALLOCATED, 0), sup(K.SUPERVISOR_START, 1), sup(K.ATTEMPT_START, 2)]
    events += [Event(K.PHASE_BEGIN, T0 + 2, 0, 0, phase=Phase.COMPILE)]
    events += [Event(K.PHASE_END, T0 + 3, 0, 0, phase=Phase.COMPILE, value=T0 + 2)]
    events += [Event(K.STEP, T0 + 4 + i, 0, 0, step=i + 1) for i in range(10)]
    events += [Event(K.CHECKPOINT_COMMIT, T0 + 9.5, 0, 0, step=6, data={"path": "/c/6"})]
    events += [Event(K.RECOMPILE, T0 + 8, 0, 0, data={"reason": "shape", "code": object()})]
    events += [
        sup(
            K.ATTEMPT_END, 14, outcome="failed", exit_code=1, signal=None, error=ValueError("x"), odd=math.nan
        )
    ]
    events += [sup(K.ATTEMPT_START, 16, 1), Event(K.RESUMED, T0 + 17, 1, 0, step=6)]
    events += [Event(K.STEP, T0 + 18 + i, 1, 0, step=7 + i) for i in range(10)]
    if stop_signal_at is not None:
        events += [sup(K.MARK, stop_signal_at, 1, name=SIGNALLED_MARK, signal="SIGTERM")]
    if job_end:
        events += [
            sup(K.ATTEMPT_END, 30, 1, outcome="completed", exit_code=0),
            sup(K.JOB_END, 31, 1, exit_status=0),
        ]
    return compute(events, T0 + 33, job_id="job-a", supervisor_alive=alive)


def test_to_dict_has_the_contract_keys_in_order_and_types() -> None:
    report = two_attempt_job()
    d = to_dict(report)
    assert list(d)[: len(CONTRACT_KEYS)] == CONTRACT_KEYS
    assert d["schema"] == SCHEMA == "ettr.report/1" and d["job_id"] == "job-a"
    for key in ("wall_s", "ett_pct", "idleness_pct", "failure_pct", "tts_s"):
        assert type(d[key]) is float, key
    assert isinstance(d["ttr_s"], list) and all(type(t) is float for t in d["ttr_s"])
    assert type(d["num_failures"]) is int and d["num_failures"] == 1
    assert list(d["buckets_s"]) == [b.value for b in Bucket]
    assert all(type(v) is float for v in d["buckets_s"].values())
    assert abs(math.fsum(d["buckets_s"].values()) - d["wall_s"]) < 1e-6
    assert d["ett_pct"] + d["idleness_pct"] + d["failure_pct"] == pytest.approx(100)
    assert len(d["attempts"]) == 2
    for a in d["attempts"]:
        assert list(a)[: len(ATTEMPT_KEYS)] == ATTEMPT_KEYS
        assert type(a["index"]) is int and type(a["lost_steps"]) is int
        assert type(a["start_ts"]) is float and type(a["end_ts"]) is float
        assert a["outcome"] in {"completed", "failed", "preempted", "hung"} and type(a["outcome"]) is str
        for key in ("exit_code", "resumed_from_step", "last_step"):
            assert a[key] is None or type(a[key]) is int
        assert list(a["buckets_s"]) == [b.value for b in Bucket]
    first, second = d["attempts"]
    assert (first["exit_code"], first["resumed_from_step"], first["last_step"], first["lost_steps"]) == (
        1,
        None,
        10,
        4,
    )
    assert (second["outcome"], second["resumed_from_step"], second["last_step"]) == ("completed", 6, 16)
    assert d["tts_s"] == pytest.approx(3.0) and d["ttr_s"] == pytest.approx([17 - 14])


def test_to_dict_is_strict_json_with_extras_only_added() -> None:
    d = to_dict(two_attempt_job())
    text = json.dumps(d, allow_nan=False)  # NaN and odd objects in event data were made plain
    assert json.loads(text) == d
    assert d["attempts"][0]["failure"] == {"signal": None, "error": "x", "odd": None}
    assert "failure" not in d["attempts"][1]
    assert d["recompiles"][0]["reason"] == "shape" and isinstance(d["recompiles"][0]["data"]["code"], str)
    assert d["checkpoint_commits"] == [{"ts": T0 + 9.5, "attempt": 0, "rank": 0, "step": 6, "path": "/c/6"}]
    assert d["in_progress"] is False and d["phases_s"] == {"compile": 1.0}
    segments = d["segments"]
    assert segments[0][0] == d["wall_start_ts"] and segments[-1][1] == d["wall_end_ts"]
    assert {s[2] for s in segments} <= {b.value for b in Bucket}
    assert "segments" not in to_dict(two_attempt_job(), include_segments=False)


def test_render_shows_summary_every_bucket_attempts_and_phases() -> None:
    report = two_attempt_job()
    text = render(report)
    assert summary_line(report) in text.splitlines()
    assert re.fullmatch(
        r"ETT \d+\.\d% \| idle \d+\.\d% \| failure \d+\.\d% \| wall 31\.0 s \| TTS 3\.0 s \| TTR 3\.0 s \| failures 1",
        summary_line(report),
    ), summary_line(report)
    for bucket in Bucket:
        assert re.search(rf"^  {bucket.value} +\d+\.\d +\d+\.\d%", text, re.M), bucket
    rows = [line.split() for line in text.splitlines() if re.match(r"^  [01]  ", line)]
    assert rows == [
        ["0", "failed", "1", "2.0", "12.0", "-", "10", "4", "1.000", "1.000"],
        ["1", "completed", "0", "16.0", "14.0", "6", "16", "0", "1.000", "1.000"],
    ]
    assert re.search(r"^  compile +1\.0$", text, re.M)
    assert "in progress" not in text and "recompiles 1" in text


def test_render_of_a_live_job_and_of_nothing() -> None:
    unknown = render(two_attempt_job(job_end=False))
    assert "in progress" in unknown and "completed" not in unknown and "failed (open)" not in unknown
    assert re.search(r"^  1  unknown ", unknown, re.M)
    empty = render(compute([], T0, job_id="none"))
    assert "no attempt recorded" in empty and "TTS -" in empty and "TTR -" in empty
    for bucket in Bucket:
        assert bucket.value in empty


def test_a_running_job_reads_running_and_a_lost_one_supervisor_lost() -> None:
    """Attempt 1 runs (steps 7..16 after resuming from the commit of step 6): no failure counted for it,
    its current work and its steps since the last checkpoint said; the same books with the supervisor gone
    read "supervisor lost at" the last event."""
    running = two_attempt_job(job_end=False, alive=True)
    text = render(running)
    title = text.splitlines()[0]
    assert title.startswith("job job-a  (running: attempt 1: training; last step 16, 6.0 s before")
    assert "10 step(s) after the last checkpoint (step 6) would be lost" in title
    assert re.search(r"^  1  running ", text, re.M) and "failures 1" in summary_line(running)
    data = to_dict(running)
    assert data["state"] == "running" and data["attempts"][1]["outcome"] == "running"
    assert data["open_job"]["steps_at_risk"] == 10 and data["open_job"]["bucket"] == "other"
    assert data["num_failures"] == 1  # attempt 0's crash, not the attempt that runs
    lost = two_attempt_job(job_end=False, alive=False)
    title = render(lost).splitlines()[0]
    assert "(supervisor lost at +27.0 s (2023-11-14 22:13:47 UTC, the last event in its books" in title
    assert "no failure is counted until a requeue says what happened" in title
    assert (
        to_dict(lost)["state"] == "supervisor_lost" and to_dict(lost)["attempts"][1]["outcome"] == "unknown"
    )
    assert to_dict(lost)["open_job"]["stop_signal"] is None and "after it got" not in title
    # Slurm's SIGTERM (a time limit, a requeue), then its SIGKILL KillWait later, before ettr closed the attempt.
    stopped = two_attempt_job(job_end=False, alive=False, stop_signal_at=26.5)
    title = render(stopped).splitlines()[0]
    assert "after it got SIGTERM at +26.5 s: the job was being stopped from outside" in title
    assert "no failure is counted until a requeue says what happened" in title
    assert to_dict(stopped)["open_job"]["stop_signal"] == "SIGTERM"
    assert to_dict(stopped)["open_job"]["stop_signal_ts"] == T0 + 26.5
    ended = to_dict(two_attempt_job())
    assert ended["state"] == "ended" and ended["open_job"] is None
    page = render_html([running, lost])
    assert (
        '<span class="badge live"' in page and ">running</span>" in page and ">supervisor lost</span>" in page
    )


def test_a_lost_job_whose_last_attempt_had_ended_does_not_say_its_failure_is_uncounted() -> None:
    """`ettr.init` alone (no `ettr run`) whose script raised: its attempt's failure is in the books, and no
    job end follows (a rerun would continue them). The report counted the failure ("failures 1") while its
    headline said "no failure is counted until a requeue says what happened"."""
    events = [sup(K.SUPERVISOR_START, 0), sup(K.ATTEMPT_START, 0)]
    events += [Event(K.STEP, T0 + 2 + i, 0, 0, step=i + 1) for i in range(5)]
    events += [Event(K.FAILURE, T0 + 7, 0, 0, data={"exception": "BrokenPipeError", "message": "x"})]
    events += [sup(K.ATTEMPT_END, 7, outcome="failed", exit_code=1, exception="BrokenPipeError")]
    report = compute(events, T0 + 7, job_id="job-b", supervisor_alive=False)
    title = render(report).splitlines()[0]
    assert "supervisor lost" in title and "failures 1" in summary_line(report)
    assert "no failure is counted" not in title
    assert "attempt 0 is counted as it ended" in title


def test_render_comparison_lists_every_metric_and_bucket() -> None:
    a, b = two_attempt_job(), two_attempt_job(job_end=False)
    text = render_comparison([a, b], labels=["baseline", "optimized"])
    header = text.splitlines()[0].split()
    assert header == ["baseline", "optimized", "change"]
    for name in ("ETT %", "idleness %", "failure %", "wall s", "TTS s", "mean TTR s", "failures"):
        assert re.search(rf"^{re.escape(name)} ", text, re.M), name
    for bucket in Bucket:
        assert re.search(
            rf"^  {bucket.value} +\d+\.\d \(\d+\.\d%\) +\d+\.\d \(\d+\.\d%\) +[+-]\d+\.\d$", text, re.M
        )
    failures = next(line for line in text.splitlines() if line.startswith("failures"))
    assert failures.split()[1:] == ["1", "1", "+0"]  # b's open attempt is not a failure (not known to be)
    three = render_comparison([a, b, a])
    assert "change" not in three and three.splitlines()[0].split() == ["job-a", "job-a", "job-a"]
    with pytest.raises(ValueError):
        render_comparison([a, b], labels=["only one"])
