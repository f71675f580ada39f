"""The one row codec: every backend writes and reads through it, and it refuses what no event can be."""

from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ettr.accounting import compute
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.ledger import ledger_path, open_ledger, read_run_events
from ettr.ledger.rows import (
    MAX_ATTEMPT,
    MAX_DATA_DEPTH,
    PLAUSIBLE_SPAN_S,
    events_from_rows,
    from_row,
    to_row,
)

T0 = 1_790_000_000.0


def _job() -> list[Event]:
    return [
        Event(EventKind.SUPERVISOR_START, T0, 0, SUPERVISOR_RANK, data={"job_id": "j"}),
        Event(EventKind.ATTEMPT_START, T0 + 1, 0, SUPERVISOR_RANK),
        Event(EventKind.PROCESS_START, T0 + 1.5, 0, 0, data={"world_size": 1}),
        *[Event(EventKind.STEP, T0 + 2 + i, 0, 0, step=i + 1) for i in range(50)],
        Event(
            EventKind.ATTEMPT_END, T0 + 60, 0, SUPERVISOR_RANK, data={"outcome": "completed", "exit_code": 0}
        ),
        Event(EventKind.JOB_END, T0 + 61, 0, SUPERVISOR_RANK, data={"exit_status": 0}),
    ]


def _insert_raw(run_dir, rows) -> None:
    with sqlite3.connect(ledger_path(run_dir)) as conn:
        conn.executemany(
            "INSERT INTO events (ts, kind, attempt, rank, phase, step, value, data) VALUES (?,?,?,?,?,?,?,?)",
            rows,
        )


@pytest.mark.parametrize(
    "row",
    [
        (T0 + 30, "step", 2**63 - 1, 0, None, 7, None, None),  # the probe's flipped attempt
        (T0 + 30, "step", -3, 0, None, 7, None, None),
        (T0 + 30, "step", 0, -5, None, 7, None, None),
        (T0 + 30, "step", 0, 2**40, None, 7, None, None),
        (T0 + 30, "step", 0, 0, None, 2**60, None, None),
        (T0 * 2, "step", 0, 0, None, 7, None, None),  # a flipped exponent bit: decades later
        (T0 / 2, "step", 0, 0, None, 7, None, None),
        (-1.0, "step", 0, 0, None, 7, None, None),
        (1e300, "step", 0, 0, None, 7, None, None),
        (float("inf"), "step", 0, 0, None, 7, None, None),
        (T0 + 30, "step", 0, 0, None, 7, "not a number", None),
        (T0 + 30, "mark", 0, 0, None, None, None, "[" * 5000 + "]" * 5000),
        (T0 + 30, "mark", 0, 0, None, None, None, '{"a":' * 100 + "1" + "}" * 100),
        (T0 + 30, "mark", 0, 0, None, None, None, "[1, 2]"),
        (T0 + 30, "step", 0, 0, "no-such-phase", 7, None, None),
    ],
)
def test_an_absurd_row_is_skipped_and_the_report_is_unchanged(tmp_path, row, caplog):
    ledger = open_ledger(tmp_path)
    ledger.append(_job())
    ledger.close()
    before = compute(read_run_events(tmp_path), T0 + 61)
    _insert_raw(tmp_path, [row])
    events = read_run_events(tmp_path)
    assert len(events) == len(_job())
    assert compute(events, T0 + 61) == before
    assert "skipped 1 unreadable ledger records" in caplog.text


def test_writing_an_absurd_event_drops_it_alone(tmp_path, caplog):
    ledger = open_ledger(tmp_path)
    bad = [
        Event(EventKind.STEP, T0, MAX_ATTEMPT + 1, 0, step=1),
        Event(EventKind.STEP, float("inf"), 0, 0, step=1),
        Event(EventKind.STEP, T0, 0, -2, step=1),
        Event(EventKind.MARK, T0, 0, 0, data={"deep": json.loads("[" * 40 + "]" * 40)}),
    ]
    ledger.append(
        [Event(EventKind.STEP, T0, 0, 0, step=1), *bad, Event(EventKind.STEP, T0 + 1, 0, 0, step=2)]
    )
    assert [e.step for e in ledger.read()] == [1, 2]
    assert "dropped an event that cannot be stored" in caplog.text
    ledger.close()


def test_deep_data_is_refused_but_ordinary_data_and_nan_round_trip():
    ok = {"nested": {"a": [1, 2, {"b": None}]}, "loss": float("nan"), "name": "x"}
    event = from_row(*to_row(Event(EventKind.MARK, T0, 0, 0, data=ok)))
    assert event is not None and event.data is not None and event.data["nested"] == ok["nested"]
    nested: object = 1
    for _ in range(MAX_DATA_DEPTH):
        nested = [nested]
    with pytest.raises(ValueError):
        to_row(Event(EventKind.MARK, T0, 0, 0, data={"x": nested}))


def test_a_time_far_from_the_rest_of_the_job_is_skipped_only_on_a_whole_job_read():
    rows = [to_row(e) for e in _job()]
    far = to_row(Event(EventKind.STEP, T0 + PLAUSIBLE_SPAN_S + 100, 0, 0, step=99))
    events, num_bad = events_from_rows([*rows, far])
    assert num_bad == 1 and len(events) == len(rows)
    assert from_row(*far) is not None  # one row alone has nothing to be far from


_ints = st.one_of(st.integers(-(2**70), 2**70), st.none(), st.floats(allow_nan=True), st.text(max_size=3))


@settings(max_examples=300, deadline=None)
@given(
    ts=st.one_of(st.floats(allow_nan=True), st.integers(-(2**70), 2**70), st.text(max_size=3), st.none()),
    kind=st.sampled_from(["step", "mark", "attempt_start", "nope", None]),
    attempt=_ints,
    rank=_ints,
    phase=st.sampled_from([None, "compile", "bad"]),
    step=_ints,
    value=st.one_of(st.floats(allow_nan=True), st.none(), st.text(max_size=2)),
    data=st.one_of(st.none(), st.just('{"a":1}'), st.just("[]"), st.just("{"), st.just("[" * 3000)),
)
def test_the_fast_path_and_the_full_check_agree_on_every_row(
    ts, kind, attempt, rank, phase, step, value, data
):
    row = (ts, kind, attempt, rank, phase, step, value, data)
    expected = from_row(*row)
    events, num_bad = events_from_rows([row])
    assert events == ([] if expected is None else [expected])
    assert num_bad == (expected is None)
    if expected is not None:  # what is read back can be written again, unchanged
        assert from_row(*to_row(expected)) == expected


def test_phase_events_keep_their_phase():
    event = Event(EventKind.PHASE_END, T0 + 2, 1, 3, Phase.COMPILE, 10, T0 + 1, {"reason": "x"})
    assert events_from_rows([to_row(event)]) == ([event], 0)
