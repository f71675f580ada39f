"""The restart policy decides from the failure's cause (`ettr.supervisor.policy`, `ettr.causes`): pure, no
processes, no clock."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from ettr.causes import Cause, Detail, diagnose
from ettr.constants import EXIT_FAILED, EXIT_HOPELESS, TRAINING_ENDED_MARK
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.supervisor.classify import AttemptEnd, classify
from ettr.supervisor.policy import EndedAttempt, RestartPolicy, ended_attempts, restarts_used

POLICY = RestartPolicy(max_restarts=3, backoff_s=0.5, max_backoff_s=30.0)
NONEXIST = ["python: can't open file '/tmp/nonexist.py': [Errno 2] No such file or directory"]


def attempt(index: int, end: AttemptEnd, *, last_step: int | None = None) -> EndedAttempt:
    return EndedAttempt(attempt=index, end=end, made_progress=last_step is not None, last_step=last_step)


def cannot_open(index: int) -> EndedAttempt:
    return attempt(index, classify(returncode=2, stderr_tail=NONEXIST))


def crash(index: int, step: int, exception: str = "ValueError") -> EndedAttempt:
    tail = ["Traceback (most recent call last):", '  File "train.py", line 9', f"{exception}: boom"]
    return attempt(index, classify(returncode=1, stderr_tail=tail), last_step=step)


def preempted(index: int, step: int | None) -> EndedAttempt:
    return attempt(index, classify(returncode=-signal.SIGTERM), last_step=step)


def test_a_script_that_cannot_start_stops_at_its_second_identical_failure_with_status_3() -> None:
    first = POLICY.decide(cannot_open(0))
    assert first.restart and first.wait_s == 0.5  # once: it may have been the file system
    second = POLICY.decide(cannot_open(1), history=[cannot_open(0)])
    assert (second.restart, second.exit_status) == (False, EXIT_HOPELESS)
    assert "failed the same way twice before its first step (exit status 2)" in second.why
    # Another start-up failure the second time is not "the same way": one more try.
    other = attempt(
        1, classify(returncode=1, stderr_tail=["Traceback (most recent call last):", "ImportError: x"])
    )
    assert POLICY.decide(other, history=[cannot_open(0)]).restart


def test_start_up_failure_is_its_own_detail_and_user_cause() -> None:
    found = cannot_open(0).diagnosis
    assert (found.cause, found.detail) == (Cause.USER, Detail.STARTUP)
    assert "before the first step" in found.evidence
    assert crash(0, 5).diagnosis.detail is Detail.EXCEPTION  # after training: an exception in the script


def test_preemptions_use_up_no_restarts_across_invocations() -> None:
    history = [preempted(i, step=10 * (i + 1)) for i in range(5)]  # five requeues, each further on
    assert restarts_used(history) == 0
    decision = POLICY.decide(crash(5, 60), history=history)
    assert decision.restart and "(1 of 3)" in decision.why
    again = POLICY.decide(preempted(5, 60), history=history)
    assert again.restart and "not counted" in again.why and again.wait_s == 0.5
    never = RestartPolicy(max_restarts=0).decide(preempted(0, 40))  # no restarts means none
    assert (never.restart, never.exit_status) == (False, 143)


def test_restarts_that_reach_no_new_step_stop_after_the_budget() -> None:
    history = [crash(0, 50), crash(1, 50)]  # resumed from 40, crashed at 50 again
    decision = POLICY.decide(crash(2, 50), history=history)
    assert (decision.restart, decision.exit_status) == (False, EXIT_HOPELESS)
    assert "2 restarts in a row reached no new step" in decision.why
    going = POLICY.decide(crash(2, 51), history=history)  # a step further: it helps
    assert going.restart
    patient = RestartPolicy(max_restarts=3, max_restarts_without_progress=0)
    assert patient.decide(crash(2, 50), history=history).restart
    out = patient.decide(crash(3, 50), history=[*history, crash(2, 50)])
    assert (out.restart, out.exit_status) == (False, EXIT_FAILED)


def replayed(index: int, first: int, last: int, message: str = "bad batch 8 of epoch 2") -> EndedAttempt:
    tail = ["Traceback (most recent call last):", '  File "multinode.py", line 9', f"RuntimeError: {message}"]
    end = classify(returncode=1, stderr_tail=tail)
    return EndedAttempt(attempt=index, end=end, made_progress=True, last_step=last, first_step=first)


def test_restarts_that_replay_the_same_crash_stop_although_their_steps_look_new() -> None:
    # pytorch/examples' DDP tutorial saves EPOCHS_RUN=N after epoch N and resumes at epoch N: each restart
    # replays an epoch, so its steps are numbered past the last failure, and it crashes on the same batch
    # 40 steps after its first step every time (found by running it under `ettr run`: exit 1 after 4 tries).
    history = [replayed(0, 1, 72), replayed(1, 65, 104)]
    assert POLICY.decide(replayed(2, 97, 136), history=history).restart  # one repeat: maybe chance
    stop = POLICY.decide(replayed(3, 129, 168), history=[*history, replayed(2, 97, 136)])
    assert (stop.restart, stop.exit_status) == (False, EXIT_HOPELESS)
    assert "2 restarts in a row failed as the attempt before them (RuntimeError, 39 steps" in stop.why
    # Numbers in the message do not make it another failure; other words, another place or a lost
    # process (infrastructure) do.
    numbered = [replayed(i, 1 + 32 * i, 40 + 32 * i, f"loss is nan at step {40 + 32 * i}") for i in range(4)]
    assert not POLICY.decide(numbered[3], history=numbered[:3]).restart
    for differs in (replayed(3, 129, 168, "another message"), replayed(3, 129, 169)):
        decision = POLICY.decide(differs, history=[*history, replayed(2, 97, 136)])
        assert decision.exit_status == EXIT_FAILED  # the restarts ran out: not "would not help"
    killed = [
        EndedAttempt(
            attempt=i,
            end=classify(returncode=-signal.SIGKILL),
            made_progress=True,
            first_step=1 + 32 * i,
            last_step=40 + 32 * i,
        )
        for i in range(4)
    ]
    assert POLICY.decide(killed[2], history=killed[:2]).restart


def test_a_replayed_crash_is_the_same_from_the_first_attempt_by_its_place_after_the_last_commit() -> None:
    # Field trial: pytorch/examples' multigpu_torchrun.py (save every epoch, resume *at* the saved epoch),
    # a ValueError on rank 1 in epoch 2: the first attempt trained from step 1 and failed at 68, each restart
    # replayed an epoch and failed at 100, 132, 164; all 4 attempts ran, each restarted at once. The
    # failure is 4 steps after the last commit every time (64, 96, 128).
    def run(index: int, first: int, last: int, commit: int | None) -> EndedAttempt:
        tail = ["Traceback (most recent call last):", "ValueError: bad shape on rank 1: expected 20, got 21"]
        end = classify(returncode=1, stderr_tail=tail)
        return EndedAttempt(
            attempt=index, end=end, made_progress=True, first_step=first, last_step=last, last_commit=commit
        )

    runs = [run(0, 1, 68, 64), run(1, 65, 100, 96), run(2, 97, 132, 128)]
    second = POLICY.decide(runs[1], history=runs[:1])
    assert second.restart and second.wait_s == 1.0  # failed as before: no longer at once
    stop = POLICY.decide(runs[2], history=runs[:2])
    assert (stop.restart, stop.exit_status) == (False, EXIT_HOPELESS)
    assert "(ValueError, 35 steps after their first step, 4 after their last checkpoint)" in stop.why
    # Another place after the commit, or no commit to go by, is not the same failure.
    for other in (run(1, 65, 101, 96), run(1, 65, 100, None)):
        decision = POLICY.decide(other, history=runs[:1])
        assert decision.restart and decision.wait_s == 0.0


def test_the_same_rank_failure_is_the_same_whichever_way_ettr_stopped_the_rest() -> None:
    # Field trial: the tutorial's NaN check behind `bash run.sh` (torchrun inside): ettr stopped the rest after
    # each rank's FloatingPointError, and the command took the stop as a wrapper's 143 in one attempt and as
    # torchrun's 1 in the next, so no two attempts were "the same" and all 4 ran, each at once.
    def run(index: int, code: int, how: str) -> EndedAttempt:
        end = AttemptEnd.from_data(
            {
                "outcome": "failed",
                "exit_code": code,
                "reason": f"rank {index % 2} failed: FloatingPointError; ettr stopped the rest ({how})",
                "exception": "FloatingPointError",
                "message": "loss is nan at epoch 2 batch 5",
            }
        )
        first = 1 if index == 0 else 65 + 32 * (index - 1)
        return EndedAttempt(
            attempt=index,
            end=end,
            made_progress=True,
            first_step=first,
            last_step=first + 35,
            last_commit=first + 31,
        )

    wrapper = "killed by SIGTERM (behind its shell wrapper, which exited 143)"
    runs = [run(0, 143, wrapper), run(1, 1, "SIGTERM to torchrun, which stopped its workers and exited 1")]
    runs.append(run(2, 143, wrapper))
    assert POLICY.decide(runs[1], history=runs[:1]).wait_s == 1.0
    assert POLICY.decide(runs[2], history=runs[:2]).exit_status == EXIT_HOPELESS
    # Both ranks raised at once in the first attempt: torchrun saw them die and exited 1 before ettr stopped
    # anything; the next attempt's stop left the wrapper's 143. The same failure still.
    first = replace(
        runs[0], end=replace(runs[0].end, exit_code=1, reason="exit status 1 (rank 0): FloatingPointError")
    )
    assert POLICY.decide(runs[1], history=[first]).wait_s == 1.0
    # Another exception, or a death by a signal, is another failure.
    other = replace(runs[1], end=replace(runs[1].end, exception="ValueError"))
    assert POLICY.decide(other, history=runs[:1]).wait_s == 0.0


def test_the_history_reads_each_attempts_last_commit_at_or_below_its_last_step() -> None:
    def ev(kind: EventKind, attempt: int, step: int, rank: int = 0) -> Event:
        return Event(kind, float(step), attempt, rank, step=step)

    events = [
        *(ev(EventKind.STEP, 0, s) for s in range(1, 69)),
        ev(EventKind.CHECKPOINT_COMMIT, 0, 32),
        ev(EventKind.CHECKPOINT_COMMIT, 0, 64),
        ev(EventKind.CHECKPOINT_COMMIT, 0, 99, rank=SUPERVISOR_RANK),  # not a training process's
        Event(EventKind.ATTEMPT_END, 70.0, 0, SUPERVISOR_RANK, data={"outcome": "failed", "exit_code": 1}),
        Event(EventKind.ATTEMPT_END, 71.0, 1, SUPERVISOR_RANK, data={"outcome": "failed", "exit_code": 1}),
    ]
    first, second = ended_attempts(events)
    assert (first.first_step, first.last_step, first.last_commit, first.steps_since_commit) == (1, 68, 64, 4)
    assert (second.made_progress, second.last_commit, second.steps_since_commit) == (False, None, None)


def test_back_off_follows_the_cause() -> None:
    assert POLICY.decide(crash(0, 5)).wait_s == 0.0  # a crash mid-training: at once
    oom = attempt(0, classify(returncode=-signal.SIGKILL, oom_killed=True), last_step=5)
    assert oom.diagnosis.detail is Detail.OOM_KILLED
    assert POLICY.decide(oom).wait_s == 0.5  # the kernel's OOM killer: memory may come free
    lost = attempt(0, classify(returncode=-signal.SIGKILL), last_step=5)
    assert lost.diagnosis.detail is Detail.PROCESS_LOST and POLICY.decide(lost).wait_s == 0.0
    assert POLICY.decide(crash(1, 20), history=[crash(0, 10)]).wait_s == 0.0  # it trained on: at once again
    assert POLICY.decide(crash(1, 10), history=[crash(0, 10)]).wait_s == 1.0  # no new step: it waits


@pytest.mark.parametrize(
    ("end", "trained", "cause", "detail"),
    [
        ({"outcome": "failed", "signal": "SIGKILL", "oom": True}, True, Cause.INFRA, Detail.OOM_KILLED),
        ({"outcome": "failed", "signal": "SIGKILL"}, True, Cause.INFRA, Detail.PROCESS_LOST),
        ({"outcome": "failed", "exception": "DistBackendError"}, True, Cause.INFRA, Detail.COLLECTIVE),
        (  # a rank died of SIGSEGV; the tail's reset is ettr's line about the in-place restart before it
            {
                "outcome": "failed",
                "exit_code": 139,
                "signal": "SIGSEGV",
                "reason": "killed by SIGSEGV (rank 1)",
                "stderr_tail": [
                    "ettr: generation 2 failed on rank 1 (RuntimeError: [pair.cc:537] Read error "
                    "[127.0.0.1]:48020: Connection reset by peer. ...); restarting in place",
                    "[rank0]:ettr: checkpoint of step 3660 failed (RuntimeError: Connection reset by peer)",
                ],
            },
            True,
            Cause.INFRA,
            Detail.PROCESS_LOST,
        ),
        (  # rank 1 segfaulted (ctypes.string_at(0)) behind a wrapper; rank 0 then died of gloo's reset, its
            # FAILURE the first recorded: it read `collective` while the console said `killed by SIGSEGV`
            {
                "outcome": "failed",
                "exit_code": 139,
                "signal": "SIGSEGV",
                "reason": "killed by SIGSEGV (rank 1; the launcher exited 1)",
                "process_failure": {
                    "exception": "RuntimeError",
                    "message": "[pair.cc:534] Read error [127.0.0.1]:5123: Connection reset by peer",
                },
                "stderr_tail": [
                    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                    "[127.0.0.1]:5123: Connection reset by peer",
                ],
            },
            True,
            Cause.INFRA,
            Detail.PROCESS_LOST,
        ),
        (  # gloo's own recv timeout (a peer SIGSTOPped): the process group's timeout, not the training code
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "exit status 1 (rank 0): RuntimeError",
                "exception": "RuntimeError",
                "message": "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 15000ms for recv operation to complete",
            },
            True,
            Cause.INFRA,
            Detail.COLLECTIVE,
        ),
        (  # kill -9 of a rank's DataLoader worker (accelerate's checkpointing.py): its RuntimeError is the
            # kill's consequence; it read `user (exception): exception RuntimeError in the training code`
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "rank 1 failed: RuntimeError; ettr stopped the rest (killed by SIGTERM)",
                "exception": "RuntimeError",
                "message": "DataLoader worker (pid 359) is killed by signal: Killed. ",
            },
            True,
            Cause.INFRA,
            Detail.PROCESS_LOST,
        ),
        (  # a real OOM kill of a worker (a 1.5 GB v1 memory cgroup): torch raised `exited unexpectedly` from the
            # `is killed by signal` it printed first; it read `user (exception)`
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "exit status 1 (out of memory): RuntimeError",
                "exception": "RuntimeError",
                "message": "DataLoader worker (pid(s) 24185) exited unexpectedly",
                "oom": True,
                "stderr_tail": ["RuntimeError: DataLoader worker (pid 24185) is killed by signal: Killed. "],
            },
            True,
            Cause.INFRA,
            Detail.OOM_KILLED,
        ),
        (  # the same without the cgroup's counter rising (a kill -9 of the worker)
            {
                "outcome": "failed",
                "exit_code": 1,
                "exception": "RuntimeError",
                "message": "DataLoader worker (pid(s) 24185) exited unexpectedly",
                "stderr_tail": ["RuntimeError: DataLoader worker (pid 24185) is killed by signal: Killed. "],
            },
            True,
            Cause.INFRA,
            Detail.PROCESS_LOST,
        ),
        (  # an exception raised in a worker is the training code's (torch re-raises it in the rank)
            {
                "outcome": "failed",
                "exit_code": 1,
                "exception": "ValueError",
                "message": "Caught ValueError in DataLoader worker process 0.",
            },
            True,
            Cause.USER,
            Detail.EXCEPTION,
        ),
        (  # the same while the cgroup's OOM-kill counter rose: the kernel's OOM killer took the worker
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "rank 1 failed: RuntimeError; ettr stopped the rest (killed by SIGTERM)",
                "exception": "RuntimeError",
                "message": "DataLoader worker (pid 359) is killed by signal: Killed. ",
                "oom": True,
            },
            True,
            Cause.INFRA,
            Detail.OOM_KILLED,
        ),
        (  # NCCL's watchdog aborts the process: its own words name the collective
            {
                "outcome": "failed",
                "signal": "SIGABRT",
                "reason": "killed by SIGABRT (rank 0)",
                "stderr_tail": ["[rank0]: Watchdog caught collective operation timeout: WorkNCCL(...)"],
            },
            True,
            Cause.INFRA,
            Detail.COLLECTIVE,
        ),
        (  # Ctrl-C to `ettr run` (a soak's SIGINT): a person stopped it, no infra fault
            {
                "outcome": "interrupted",
                "signal": "SIGINT",
                "reason": "interrupted (SIGINT forwarded to the job); killed by SIGINT",
            },
            True,
            Cause.PREEMPTION,
            Detail.PREEMPTED,
        ),
        (  # ettr.resilient's rendezvous: a peer never joined (SIGSTOPped in its start-up in a soak): not user's
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "exit status 1 (rank 1)",
                "exception": "RendezvousTimeout",
                "message": "generation 7: 1 of 2 ranks joined in 120 s",
            },
            False,
            Cause.INFRA,
            Detail.COLLECTIVE,
        ),
        (  # rank 0 SIGKILLed (an OOM-like kill): rank 1's connection error is its consequence
            {
                "outcome": "failed",
                "signal": "SIGKILL",
                "reason": "killed by SIGKILL (rank 0)",
                "process_failure": {"exception": "DistBackendError", "message": "Connection reset by peer"},
            },
            True,
            Cause.INFRA,
            Detail.PROCESS_LOST,
        ),
        (
            {"outcome": "failed", "stderr_tail": ["Watchdog caught collective operation timeout"]},
            True,
            Cause.INFRA,
            Detail.COLLECTIVE,
        ),
        (
            {
                "outcome": "failed",
                "reason": "its supervisor was lost (killed) while it ran; closed from the ledger",
            },
            True,
            Cause.INFRA,
            Detail.NODE_LOST,
        ),
        (  # node 1 died: node 0's ranks saw the reset first, the leader then found node 1 silent
            {
                "outcome": "failed",
                "exit_code": 1,
                "reason": "node 1's supervisor is silent for over 4 s (lost)",
                "stderr_tail": ["[rank0]: RuntimeError: ... Connection reset by peer"],
                "process_failure": {"exception": "DistBackendError", "message": "Connection reset by peer"},
            },
            True,
            Cause.INFRA,
            Detail.NODE_LOST,
        ),
        ({"outcome": "failed", "exit_code": 1, "exception": "KeyError"}, True, Cause.USER, Detail.EXCEPTION),
        (  # rank 1 crashed (its own exception); the output's tail is rank 0's gloo error, the consequence
            {
                "outcome": "failed",
                "exit_code": 1,
                "exception": "InjectedCrash",
                "message": "crash@step=35,attempt=0,rank=1 at step 35",
                "stderr_tail": [
                    "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
                ],
                "process_failure": {"exception": "InjectedCrash", "message": "crash@step=35"},
            },
            True,
            Cause.USER,
            Detail.EXCEPTION,
        ),
        (  # the failed rank's own words name a broken collective or the hardware: those still count
            {
                "outcome": "failed",
                "exit_code": 1,
                "exception": "RuntimeError",
                "message": "NCCL error: unhandled system error",
            },
            True,
            Cause.INFRA,
            Detail.COLLECTIVE,
        ),
        (
            {
                "outcome": "failed",
                "exit_code": 1,
                "exception": "RuntimeError",
                "process_failure": {
                    "exception": "RuntimeError",
                    "message": "CUDA error: uncorrectable ECC error encountered",
                },
            },
            True,
            Cause.INFRA,
            Detail.HARDWARE,
        ),
        (  # a script piped into `head`: its print() hit the closed pipe; nothing distributed about it
            {
                "outcome": "failed",
                "exit_code": 1,
                "process_failure": {"exception": "BrokenPipeError", "message": "[Errno 32] Broken pipe"},
            },
            True,
            Cause.USER,
            Detail.EXCEPTION,
        ),
        ({"outcome": "failed", "exit_code": 1, "exception": "KeyError"}, False, Cause.USER, Detail.STARTUP),
        (
            {"outcome": "failed", "exit_code": 127, "reason": "cannot start: x"},
            False,
            Cause.USER,
            Detail.STARTUP,
        ),
        ({"outcome": "failed", "exit_code": 3}, True, Cause.UNKNOWN, Detail.UNKNOWN),
        ({"outcome": "hung"}, True, Cause.HANG, Detail.HUNG),
        ({"outcome": "preempted"}, False, Cause.PREEMPTION, Detail.PREEMPTED),
        (
            {"outcome": "failed", "exit_code": "1", "signal": 9, "stderr_tail": "x"},
            True,
            Cause.UNKNOWN,
            Detail.UNKNOWN,
        ),
    ],
)
def test_every_failure_gets_a_cause_and_a_detail(end, trained, cause, detail) -> None:
    found = diagnose(outcome=Outcome(end["outcome"]), failure=end, trained=trained)
    assert (found.cause, found.detail) == (cause, detail) and found.evidence


def test_the_books_history_reads_what_earlier_invocations_recorded() -> None:
    def end(attempt: int, **data: object) -> Event:
        return Event(EventKind.ATTEMPT_END, 10.0 + attempt, attempt, SUPERVISOR_RANK, data=data)

    events = [
        Event(EventKind.STEP, 1.0, 0, 0, step=7),
        end(0, outcome="preempted", exit_code=143, signal="SIGTERM"),
        end(0, outcome="failed"),  # a second end of the same attempt is not read
        end(1, outcome="failed", exit_code=2, stderr_tail=NONEXIST),
        end(
            2, outcome="bogus", exit_code=True, oom="yes", stderr_tail=[1, 2]
        ),  # forged: read as far as it can be
    ]
    history = ended_attempts(events)
    assert [(h.attempt, h.end.outcome, h.made_progress, h.last_step) for h in history] == [
        (0, Outcome.PREEMPTED, True, 7),
        (1, Outcome.FAILED, False, None),
        (2, Outcome.UNKNOWN, False, None),
    ]
    assert history[2].end.exit_code is None and history[2].end.oom is False
    assert restarts_used(history) == 1  # the preemption is not counted
    again = POLICY.decide(cannot_open(3), history=history[:2])
    assert again.exit_status == EXIT_HOPELESS  # the same start-up failure, one invocation later


def test_back_off_doubles_per_restart_that_reached_no_new_step_not_per_restart_used() -> None:
    # A long job that failed 40 times, each attempt training past the furthest step before it: every restart
    # at once (it used to wait 0.5 s doubling per restart used: 30 s before each restart from the 8th on).
    policy = RestartPolicy(max_restarts=100)
    history = [crash(i, 10 * (i + 1)) for i in range(40)]
    for i in range(1, 40):
        assert policy.decide(history[i], history=history[:i]).wait_s == 0.0
    # A restart that reached no new step waits, and the wait doubles while the restarts do not train on.
    stuck = RestartPolicy(max_restarts=100, max_restarts_without_progress=0)
    stalled = [*history, crash(40, 1000), crash(41, 1000), crash(42, 1000)]
    assert stuck.decide(stalled[40], history=stalled[:40]).wait_s == 0.0  # step 1000: new
    assert stuck.decide(stalled[41], history=stalled[:41]).wait_s == 1.0
    assert stuck.decide(stalled[42], history=stalled[:42]).wait_s == 2.0
    # Training on again resets it.
    assert stuck.decide(crash(43, 1001), history=stalled).wait_s == 0.0


def _ended(index: int, end: AttemptEnd, **fields: object) -> EndedAttempt:
    trained = fields.get("last_step") is not None
    return EndedAttempt(attempt=index, end=end, made_progress=trained, **fields)  # type: ignore[arg-type]


KILLED = classify(returncode=-signal.SIGKILL)


def test_restarts_that_reach_the_end_of_training_are_finishing_not_stalling() -> None:
    # spare_kills seed 0: rank 1 killed after its training function returned at step 80 (the last), its
    # promoted spare killed in the in-place attempt, the restarted rank 1 killed right after restoring 80.
    # Training was over and committed; "2 restarts in a row reached no new step: restarts would not help".
    done = _ended(0, KILLED, last_step=80, first_step=1, last_commit=80, ended_training_at=80)
    spare = _ended(1, KILLED)
    restored = _ended(2, KILLED, resumed_step=80)
    decision = POLICY.decide(restored, history=[done, spare])
    assert decision.restart and "(3 of 3)" in decision.why  # max_restarts still counts each failure
    # The same books without the end of the loop (an unmodified script): today's rule.
    blind = POLICY.decide(restored, history=[replace(done, ended_training_at=None), spare])
    assert (blind.restart, blind.exit_status) == (False, EXIT_HOPELESS)
    assert "2 restarts in a row reached no new step" in blind.why
    # The restart that said it itself counts as much as the attempt before it did.
    own = replace(restored, ended_training_at=80)
    assert POLICY.decide(own, history=[replace(done, ended_training_at=None), spare]).restart
    # A restart that never reached that step still stalls: a node that dies during every start-up, or a
    # resume that crashes before step 80 again (from 75), stops as before.
    for stalled in (_ended(2, KILLED), crash(2, 78)):
        stop = POLICY.decide(stalled, history=[done, _ended(1, KILLED, resumed_step=75)])
        assert (stop.restart, stop.exit_status) == (False, EXIT_HOPELESS)
    # An end of the loop below the job's furthest step is no end of the job.
    early = replace(done, ended_training_at=60)
    stop = POLICY.decide(_ended(2, KILLED, resumed_step=80), history=[early, spare])
    assert stop.exit_status == EXIT_HOPELESS


def test_a_job_that_fails_every_time_in_its_shutdown_still_stops() -> None:
    def publish(index: int, **fields: object) -> EndedAttempt:
        tail = ["Traceback (most recent call last):", "RuntimeError: publish failed: 403 Forbidden"]
        return _ended(index, classify(returncode=1, stderr_tail=tail), ended_training_at=80, **fields)

    # Resumes that train no step: rule 3, at the second failure after the end (as rule 4 did before).
    runs = [publish(0, last_step=80, first_step=1, last_commit=80), publish(1, resumed_step=80)]
    assert POLICY.decide(runs[1], history=runs[:1]).restart
    stop = POLICY.decide(publish(2, resumed_step=80), history=runs)
    assert (stop.restart, stop.exit_status) == (False, EXIT_HOPELESS)
    assert "failed the same way twice after its training ended (RuntimeError, exit status 1)" in stop.why
    # Resumes that replay steps up to the end (from the checkpoint before it): rule 5.
    replays = [publish(0, last_step=80, first_step=1, last_commit=80)]
    replays += [publish(i, last_step=80, first_step=76, last_commit=80, resumed_step=75) for i in (1, 2)]
    assert POLICY.decide(replays[1], history=replays[:1]).restart
    stop = POLICY.decide(replays[2], history=replays[:2])
    assert (stop.restart, stop.exit_status) == (False, EXIT_HOPELESS)
    assert "2 restarts in a row failed as the attempt before them (RuntimeError" in stop.why
    # A hang in the teardown after every resume: `max_restarts`.
    hung = [
        _ended(
            0,
            AttemptEnd(outcome=Outcome.HUNG, exit_code=None),
            last_step=80,
            first_step=1,
            ended_training_at=80,
        ),
        *(
            _ended(i, AttemptEnd(outcome=Outcome.HUNG, exit_code=None), resumed_step=80, ended_training_at=80)
            for i in (1, 2, 3)
        ),
    ]
    for i in (1, 2):
        assert POLICY.decide(hung[i], history=hung[:i]).restart
    out = POLICY.decide(hung[3], history=hung[:3])
    assert (out.restart, out.exit_status, out.why) == (False, EXIT_FAILED, "no restarts left")


def test_the_history_reads_each_attempts_resume_and_end_of_training() -> None:
    def end(attempt: int) -> Event:
        return Event(
            EventKind.ATTEMPT_END, 100.0 + attempt, attempt, SUPERVISOR_RANK, data={"outcome": "failed"}
        )

    def ended_mark(attempt: int, step: int, rank: int = 0) -> Event:
        return Event(EventKind.MARK, 90.0, attempt, rank, step=step, data={"name": TRAINING_ENDED_MARK})

    events = [
        *(Event(EventKind.STEP, float(s), 0, 0, step=s) for s in range(1, 81)),
        ended_mark(0, 80),
        ended_mark(0, 99, rank=SUPERVISOR_RANK),  # not a training process's
        Event(EventKind.MARK, 91.0, 0, 1, step=120, data={"name": "other"}),
        end(0),
        Event(EventKind.RESUMED, 101.0, 1, 1, step=80),
        Event(EventKind.RESUMED, 101.0, 1, 0, step=None),
        end(1),
    ]
    first, second = ended_attempts(events)
    assert (first.last_step, first.resumed_step, first.ended_training_at, first.reached_step) == (
        80,
        None,
        80,
        80,
    )
    assert (second.made_progress, second.resumed_step, second.ended_training_at, second.reached_step) == (
        False,
        80,
        None,
        80,
    )
