"""`--inject` specs and the in-process injector (with a fake recorder and fake fault actions)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ettr import inject
from ettr.cli import main as cli_main
from ettr.errors import UsageError
from ettr.events import EventKind
from ettr.inject import FaultKind, FaultSpec, Injector, Trigger, decode_specs, encode_specs, parse_spec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("crash@step=5", FaultSpec(kind=FaultKind.CRASH, trigger=Trigger.STEP, step=5)),
        (
            "kill@time=2.5,attempt=1,rank=3",
            FaultSpec(kind=FaultKind.KILL, trigger=Trigger.TIME, time_s=2.5, attempt=1, rank=3),
        ),
        ("hang@checkpoint", FaultSpec(kind=FaultKind.HANG, trigger=Trigger.CHECKPOINT)),
        ("PREEMPT@step=0, rank=1", FaultSpec(kind=FaultKind.PREEMPT, trigger=Trigger.STEP, step=0, rank=1)),
    ],
)
def test_parse_spec_accepts_the_contract_forms(text: str, expected: FaultSpec) -> None:
    assert parse_spec(text) == expected
    assert parse_spec(str(expected)) == expected  # str() is a spec again


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "expected KIND@WHEN"),
        ("crash", "expected KIND@WHEN"),
        ("crash@", "expected KIND@WHEN"),
        ("boom@step=1", "unknown kind 'boom'"),
        ("crash@step=-1", "step must be >= 0"),
        ("crash@step=x", "step must be a whole number"),
        ("crash@time=soon", "time must be seconds"),
        ("crash@time=inf", "seconds from 0 to 315,360,000 (ten years)"),
        ("crash@time=1e300", "seconds from 0 to 315,360,000 (ten years)"),  # a timer's OverflowError
        ("crash@later", "unknown WHEN 'later'"),
        ("crash@step=1,node=2", "unknown option 'node=2'"),
        ("crash@step=1,rank=1,rank=2", "rank= given twice"),
        ("crash@step=1,attempt=-2", "attempt must be >= 0"),
    ],
)
def test_parse_spec_rejects_bad_specs_with_one_clear_line(text: str, says: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_spec(text)
    message = str(caught.value)
    assert says in message and "\n" not in message and repr(text) in message


def test_bad_inject_on_the_command_line_is_exit_2_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = cli_main(["run", "--inject", "crash@step=oops", "--", "python", "-c", "pass"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "step must be a whole number" in err and "Traceback" not in err


def test_specs_travel_through_the_environment_value() -> None:
    specs = (parse_spec("crash@step=3,rank=1"), parse_spec("kill@time=0.5,attempt=2"))
    assert decode_specs(encode_specs(specs)) == specs
    assert decode_specs("") == () and decode_specs("{not json") == ()


@pytest.mark.parametrize(
    "value",
    [
        "[" * 5000,  # RecursionError: 'bootstrap failed ...; the script runs uninstrumented'
        '[{"kind": "crash", "trigger": "step", "step": 1, "attempt": 1e400}]',  # int(inf): OverflowError, the same
        '[{"kind": "crash", "trigger": "step", "step": true}]',  # fired at step 1
        '[{"kind": "crash", "trigger": "time", "time_s": 1e300}]',  # a traceback from the timer's thread
        '[{"kind": "crash", "trigger": "step", "step": 2.5}]',
        '"crash"',
    ],
)
def test_an_environment_value_ettr_run_never_writes_is_no_fault_never_an_exception(value: str) -> None:
    assert decode_specs(value) == ()


class FakeRecorder:
    def __init__(self, attempt: int = 0, rank: int = 0) -> None:
        self.attempt, self.rank = attempt, rank
        self.listeners: list[Any] = []
        self.calls: list[Any] = []

    def add_step_listener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def record(self, kind: EventKind, **kwargs: Any) -> None:
        self.calls.append((kind, kwargs.get("data")))

    def flush(self, timeout_s: float = 5.0) -> None:
        self.calls.append("flush")

    def step(self, n: int) -> None:
        for listener in self.listeners:
            listener(n)


class FakeActions(inject.FaultActions):
    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []
        self.fired = threading.Event()

    def _note(self, what: str) -> None:
        self.done.append((what, threading.current_thread().name))
        self.fired.set()

    def crash(self) -> None:
        self._note("crash")

    def kill(self) -> None:
        self._note("kill")

    def hang(self) -> None:
        self._note("hang")

    def preempt(self, wait_s: float) -> None:
        self._note(f"preempt wait={wait_s:g}")


def test_step_fault_fires_once_right_after_step_n_on_its_rank_and_attempt_only() -> None:
    specs = [parse_spec("crash@step=3,rank=1"), parse_spec("kill@step=2,rank=0")]
    rec, actions = FakeRecorder(attempt=0, rank=1), FakeActions()
    injector = Injector(specs, rec, actions=actions)
    injector.start()
    assert [str(s) for s in injector.specs] == ["crash@step=3,attempt=0,rank=1"]
    for n in (1, 2, 3, 3, 4):
        rec.step(n)
    assert [what for what, _ in actions.done] == ["crash"]
    # Recorded and flushed before the fault: a MARK naming it and, for a crash, the FAILURE.
    kinds = [c[0] if c != "flush" else c for c in rec.calls]
    assert kinds == [EventKind.MARK, EventKind.FAILURE, "flush"]
    assert rec.calls[0][1]["spec"] == "crash@step=3,attempt=0,rank=1"

    other_attempt = FakeRecorder(attempt=1, rank=1)
    quiet = FakeActions()
    Injector(specs, other_attempt, actions=quiet).start()
    other_attempt.step(3)
    assert quiet.done == []


def test_time_fault_fires_from_a_timer_and_a_timed_hang_blocks_the_next_step() -> None:
    rec, actions = FakeRecorder(), FakeActions()
    Injector([parse_spec("preempt@time=0")], rec, actions=actions).start()
    assert actions.fired.wait(10)
    assert actions.done == [("preempt wait=0", "ettr-inject")]  # off the training thread: no waiting

    rec, actions = FakeRecorder(), FakeActions()
    injector = Injector([parse_spec("hang@time=0")], rec, actions=actions)
    injector.start()
    for timer in injector._timers:
        timer.join(10)
    assert actions.done == []  # only the training thread can stop the training
    rec.step(1)
    assert actions.done == [("hang", threading.current_thread().name)]
    rec.step(2)
    assert len(actions.done) == 1


def test_checkpoint_fault_fires_through_the_module_hook_point() -> None:
    rec, actions = FakeRecorder(), FakeActions()
    inject.checkpoint_in_progress()  # nothing installed: a no-op
    injector = Injector([parse_spec("kill@checkpoint")], rec, actions=actions, preempt_wait_s=0)
    inject.install(injector)
    try:
        rec.step(1)
        assert actions.done == []
        inject.checkpoint_in_progress()
        inject.checkpoint_in_progress()
        assert [what for what, _ in actions.done] == ["kill"]
    finally:
        inject.install(None)


_HANDLES_SIGTERM = """
import os, signal, sys, threading, time
from ettr.inject import FaultActions
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()   # the forwarded signal
t0 = time.monotonic()
FaultActions().preempt(30.0)
print(f"{time.monotonic() - t0:.2f} {got}")
"""


def test_preempt_waits_only_until_the_sigterm_arrives_and_the_script_still_handles_it(tmp_path):
    import subprocess
    import sys

    # No supervisor pid: the injector signals its own process group; run it in a group of its own.
    out = subprocess.run(
        [sys.executable, "-c", _HANDLES_SIGTERM],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr
    waited_s, handled = out.stdout.split(maxsplit=1)
    assert float(waited_s) < 10.0  # not the full 30 s: well inside the supervisor's grace period
    assert "15" in handled  # the script's own handler got the signal


def test_why_a_step_fault_never_fired_is_said_from_the_steps_the_attempts_ran() -> None:
    spec = parse_spec("crash@step=120")
    # The README's second command, run where the first left its finished checkpoint: resumed at 200.
    assert "completed no training step" in inject.why_unfired(spec, {0: (None, None)})
    assert "began at step 151, past step 120" in inject.why_unfired(spec, {0: (151, 200)})
    assert inject.why_unfired(spec, {0: (1, 80)}) == "attempt 0 ended at step 80"
    assert inject.why_unfired(parse_spec("crash@step=5,attempt=2"), {0: (1, 9), 1: (10, 20)}) == (
        "the job ended after attempt 1"
    )
    assert inject.why_unfired(spec, {0: (1, 200)}) == ""  # it should have fired: nothing to explain
    assert inject.why_unfired(spec, {3: (1, 9)}) == ""  # attempt 0 was an earlier run's (a requeue)
    assert inject.why_unfired(spec, {}) == ""
    assert inject.why_unfired(parse_spec("crash@time=5"), {0: (None, None)}) == ""
