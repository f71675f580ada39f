"""`ettr report`'s text columns."""


def test_a_step_under_half_a_millisecond_is_not_shown_as_zero():
    # The attempts table showed `0.000` for a 0.12 ms step (docs trial): a number that reads as no time.
    from ettr.report.text import _step_s

    assert _step_s(0.00012) == "0.00012" and _step_s(0.049) == "0.049" and _step_s(12.34) == "12.3"
    assert _step_s(None) == "-" and _step_s(0.0) == "0.000"


def test_the_failure_instants_the_accounting_uses_are_no_unix_times_in_the_text_or_the_timeline():
    """`signalled_ts` and `rank_gone_ts` (ATTEMPT_END keys the accounting takes the failure instant from)
    were printed raw under the failure: `signal=SIGKILL, rank_gone_ts=1796402196.741017`."""
    from ettr.accounting import compute
    from ettr.events import SUPERVISOR_RANK, Event, EventKind
    from ettr.report.charts import failure_summary
    from ettr.report.text import _failure_lines

    failure = {"outcome": "failed", "exit_code": 137, "reason": "killed by SIGKILL", "signal": "SIGKILL",
               "rank_gone_ts": 1796402196.741017, "signalled_ts": 1796402190.5}  # fmt: skip
    text = "\n".join(_failure_lines(0, "failed", failure))
    assert "1796402" not in text and "SIGKILL" in text
    t0, s = 1_700_000_000.0, SUPERVISOR_RANK
    events = [
        Event(EventKind.SUPERVISOR_START, t0, 0, s),
        Event(EventKind.ATTEMPT_START, t0, 0, s),
        Event(EventKind.PROCESS_START, t0, 0, 0),
        Event(EventKind.STEP, t0 + 1, 0, 0, step=1),
        Event(EventKind.ATTEMPT_END, t0 + 2, 0, s, data=failure),
        Event(EventKind.JOB_END, t0 + 3, 0, s, data={"exit_status": 1}),
    ]
    (attempt,) = compute(events, t0 + 3).attempts
    shown = failure_summary(attempt)
    assert "1796402" not in shown and "SIGKILL" in shown


def test_a_ranks_exception_under_a_forwarded_preemption_is_said_to_be_its_consequence() -> None:
    """Field trial (a Lightning DDP script behind a bash wrapper, SIGTERM to `ettr run`): the preempted attempt
    read `RuntimeError: ... Connection reset by peer` under `SIGTERM forwarded to the job; killed by SIGTERM`,
    a rank's broken connection after the stop shown as if it were a crash of its own."""
    from ettr.report.text import _failure_lines

    failure = {
        "signal": "SIGTERM",
        "reason": "SIGTERM forwarded to the job; killed by SIGTERM",
        "exception": "RuntimeError",
        "message": "Read error: Connection reset by peer",
        "process_failure": {"exception": "RuntimeError", "message": "Connection reset by peer", "rank": 0},
    }
    assert _failure_lines(0, "preempted", failure)[1] == (
        "    RuntimeError: Read error: Connection reset by peer"
        " (during the preemption: its consequence, not the cause)"
    )
    unsignalled = {**failure, "signal": None, "reason": "SIGTERM forwarded to the job; exit status 1"}
    assert _failure_lines(0, "preempted", unsignalled)[1].endswith(
        "(rank 0, during the preemption: its consequence, not the cause)"
    )
    # A hang that ettr stopped: what the processes raised at its SIGTERM is the stop's, not the hang's
    # (fabric run behind bash, rank 1 hung: `SignalException: Process 3259 got signal: 15` under `hung`).
    hung = {
        "signal": "SIGTERM",
        "reason": "no progress and no heartbeat for 15.1 s (over --hang-timeout: 15 s); killed by SIGTERM",
        "exception": "SignalException",
        "message": "Process 3259 got signal: 15",
    }
    assert _failure_lines(0, "hung", hung)[1] == (
        "    SignalException: Process 3259 got signal: 15 (after ettr stopped the hung job: its consequence)"
    )
    # A failure of its own (no forwarded preemption) keeps its plain rank.
    crashed = {**unsignalled, "reason": "exit status 1 (rank 0): RuntimeError"}
    assert _failure_lines(0, "failed", crashed)[1].endswith("Connection reset by peer (rank 0)")
