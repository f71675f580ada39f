"""Whether, and when, a job is restarted after an attempt: the restart policy (pure: no I/O, no clock).

    decision = policy.decide(ended, history=earlier, signalled=None)
    decision.restart -> wait decision.wait_s, then the next attempt; else exit with decision.exit_status

Each decision is taken from the ended attempt's cause (`ettr.causes.diagnose`: the same rules the report
shows), whether and how far it trained, and every earlier attempt of the job (`history`, oldest first: the
books' attempts from earlier `ettr run` invocations of a requeued job, then this supervisor's). The rules, in
order:

1. a completed attempt ends the job: exit 0;
2. a signal to the supervisor (preemption, Ctrl-C) ends it: 143, or 130 for SIGINT, no restart (the
   scheduler requeues the job);
3. the same failure twice in a row before the first step (a script that cannot start: same cause, exit
   status, signal and exception; user or unknown cause) stops at once: exit 3, restarts would not help;
4. `max_restarts_without_progress` restarts in a row that reached no step beyond the furthest step of
   any attempt before them stop the job: exit 3 (a crash at the same step after every resume, a hang
   at the same place, a node that dies during every start-up). A restart that reached the step at which
   the job's training ended (`TRAINING_ENDED_MARK`) is finishing, not stalling, and ends the count
   (`finishing`: until 2026-12-05 a resilient job killed three times after its last step stopped here, its
   training over). Its failures are the job's shutdown's: one that fails the same way there after every
   resume (a publish that raises) stops by rule 3 (resumes that train no step) or 5 (resumes that replay
   up to the end); one that fails otherwise each time (a hang in its teardown, kills) by `max_restarts`.
   Without that mark (an unmodified script records none) the rule is as it was;
5. `max_restarts_without_progress` restarts in a row that each failed exactly as the attempt before it,
   after training -- the same exception and message (numbers aside; user or unknown cause) the same
   number of steps after its first step, or after its last checkpoint commit -- stop the job: exit 3. A
   script whose resume replays work (it saves "epoch N" after epoch N and resumes *at* epoch N:
   pytorch/examples' DDP tutorial) numbers every replay as new steps, so rule 4 never sees the crash at the
   same data; its place relative to the attempt's first step does, from the first restart on, and its
   place after the last commit does from the job's first attempt (which trained from step 1, not from the
   resume point: a rank-1 ValueError in the tutorial ran 4 attempts, each at once, before this);
6. failures use up `max_restarts` (job-wide, across invocations); preemptions and interruptions do not:
   with none left, exit 1 (`max_restarts` 0: nothing is restarted, a preemption of the job exits 143);
7. otherwise restart, after a back-off that follows the cause:

   | cause (detail)                                     | first restart | later restarts           |
   |----------------------------------------------------|---------------|--------------------------|
   | failure or hang after progress (exception, process or node lost, collective, hardware, hung) | at once | `backoff_s` doubling |
   | the kernel's OOM killer (oom_killed)               | `backoff_s`   | doubling                 |
   | a failure before the first step (startup, ...)     | `backoff_s`   | doubling                 |
   | preemption of the job's processes (not of the supervisor) | `backoff_s` | `backoff_s` (not counted) |

   Doubling is per restart in a row that reached no new step (rule 4's count), or that failed exactly as the
   attempt before it (rule 5's count: a deterministic error in a script that replays work looks like
   progress, and restarted at once each time), up to `max_backoff_s`: an attempt that trained past the
   furthest step before it, failing otherwise, resets it. Until 2026-12-04 it was per restart the
   job had used, so a long job's every failure after its 7th waited 30 s however long it had trained since
   (soak, a 2-rank job killed every 25-50 s, each attempt training on: 0, 1, 2, 4, 8, 16 s, then 30 s before
   every later restart).

Exit statuses and what a scheduler should do with each: docs/supervisor.md, "Exit statuses".
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ettr.causes import Cause, Detail, Diagnosis, diagnose, signature
from ettr.constants import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_HOPELESS,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    TRAINING_ENDED_MARK,
)
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Outcome
from ettr.supervisor.classify import AttemptEnd

_COUNTED = frozenset({Outcome.FAILED, Outcome.HUNG})
"""Outcomes that use up `max_restarts` (not preemptions, not interruptions)."""
_STALLS = frozenset({Outcome.FAILED, Outcome.HUNG, Outcome.PREEMPTED})
"""Outcomes of a restart that can fail to help (rule 4)."""


@dataclass(frozen=True, kw_only=True)
class EndedAttempt:
    """One ended attempt, as the policy sees it."""

    attempt: int
    end: AttemptEnd
    """Its classification (the ATTEMPT_END data)."""
    made_progress: bool
    """A training process of the attempt completed a step (its failure came after progress)."""
    last_step: int | None = None
    """The highest step a training process of the attempt completed (None: none, or not numbered)."""
    first_step: int | None = None
    """The lowest step a training process of the attempt completed (the first after its resume point)."""
    last_commit: int | None = None
    """The highest step at or below `last_step` whose checkpoint the attempt committed (None: none)."""
    resumed_step: int | None = None
    """The highest step a training process of the attempt resumed from (its RESUMED; None: none, or scratch)."""
    ended_training_at: int | None = None
    """The highest step at which a training process of the attempt said its training loop had ended
    (`TRAINING_ENDED_MARK`; None: none said so, as an unmodified script never does)."""

    @property
    def reached_step(self) -> int | None:
        """The furthest step the attempt's state reached: completed, resumed from, or ended training at."""
        return max(
            (s for s in (self.last_step, self.resumed_step, self.ended_training_at) if s is not None),
            default=None,
        )

    @property
    def steps_run(self) -> int | None:
        """How many steps after its own first step it ended (None: unknown)."""
        if self.first_step is None or self.last_step is None:
            return None
        return self.last_step - self.first_step

    @property
    def steps_since_commit(self) -> int | None:
        """How many steps after its last checkpoint commit it ended (None: no commit, or unknown)."""
        if self.last_commit is None or self.last_step is None:
            return None
        return self.last_step - self.last_commit

    @cached_property
    def diagnosis(self) -> Diagnosis:
        """Its cause (`ettr.causes.diagnose`)."""
        return diagnose(outcome=self.end.outcome, failure=self.end.to_data(), trained=self.made_progress)

    @property
    def signature(self) -> tuple[str, ...]:
        """What makes two failures 'the same way'."""
        return signature(self.end.outcome, self.end.to_data(), self.diagnosis)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do after an attempt."""

    restart: bool
    wait_s: float = 0.0
    """Before the next attempt (when `restart`)."""
    exit_status: int | None = None
    """The job's exit status (when not `restart`)."""
    why: str = ""
    """For people: `restarting in 0.5 s (1 of 3)`, `no restarts left`, `not restarting`."""


def stopped_status(signum: int) -> int:
    """The exit status of a job the supervisor was asked to stop by `signum`: 130 for SIGINT, else 143."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def backoff_wait_s(
    restart: int,
    *,
    outcome: Outcome,
    made_progress: bool,
    backoff_s: float,
    max_backoff_s: float,
    detail: Detail | None = None,
) -> float:
    """Seconds to wait before the next restart, `restart` restarts in a row having reached no new step
    (`restarts_without_progress`): the table of rule 7 above."""
    if outcome is Outcome.PREEMPTED:
        return min(max_backoff_s, backoff_s)
    transient = made_progress and outcome in _COUNTED and detail is not Detail.OOM_KILLED
    if restart == 0 and transient:
        return 0.0
    return min(max_backoff_s, backoff_s * 2**restart)


def ended_from_events(attempt: int, end: AttemptEnd, events: Iterable[Event]) -> EndedAttempt:
    """One ended attempt with how far it trained, from its events (its training processes' steps and
    checkpoint commits)."""
    trained = False
    steps: list[int] = []
    commits: list[int] = []
    resumed: list[int] = []
    ended: list[int] = []
    numbered = {EventKind.STEP: steps, EventKind.CHECKPOINT_COMMIT: commits, EventKind.RESUMED: resumed}
    for e in events:
        if e.rank < 0:
            continue
        trained = trained or e.kind is EventKind.STEP
        if not isinstance(e.step, int) or isinstance(e.step, bool):
            continue
        if e.kind is EventKind.MARK and (e.data or {}).get("name") == TRAINING_ENDED_MARK:
            ended.append(e.step)
        elif e.kind in numbered:
            numbered[e.kind].append(e.step)
    last = max(steps, default=None)
    return EndedAttempt(
        attempt=attempt,
        end=end,
        made_progress=trained,
        last_step=last,
        first_step=min(steps, default=None),
        last_commit=max((c for c in commits if last is not None and c <= last), default=None),
        resumed_step=max(resumed, default=None),
        ended_training_at=max(ended, default=None),
    )


def ended_attempts(events: Sequence[Event]) -> list[EndedAttempt]:
    """The ended attempts a job's books hold (the first ATTEMPT_END of each, oldest first), with how far each
    trained: the history a requeued job's supervisor decides with."""
    ends: dict[int, Mapping[str, Any]] = {}
    by_attempt: dict[int, list[Event]] = {}
    for e in events:
        if e.kind is EventKind.ATTEMPT_END and e.rank == SUPERVISOR_RANK:
            ends.setdefault(e.attempt, e.data or {})
        else:
            by_attempt.setdefault(e.attempt, []).append(e)
    return [
        ended_from_events(attempt, AttemptEnd.from_data(data), by_attempt.get(attempt, ()))
        for attempt, data in sorted(ends.items())
    ]


_NUMBER = re.compile(r"\d+")


def fails_alike(ended: EndedAttempt, previous: EndedAttempt) -> bool:
    """`ended` failed as `previous` did after training, wherever: the same cause, detail, exit status, signal,
    exception and message (its numbers aside: a step or a loss in it), user or unknown cause."""
    if not (ended.made_progress and previous.made_progress):
        return False
    if ended.diagnosis.cause not in (Cause.USER, Cause.UNKNOWN) or ended.signature != previous.signature:
        return False
    said = [_NUMBER.sub("#", (a.end.message or "").strip()) for a in (ended, previous)]
    return said[0] == said[1]


def repeats_exactly(ended: EndedAttempt, previous: EndedAttempt) -> bool:
    """`ended` failed exactly as `previous` did (rule 5): alike (`fails_alike`), at the same place: the same
    number of steps after each attempt's first step, or after each attempt's last checkpoint commit."""
    if not fails_alike(ended, previous):
        return False
    same_run = ended.steps_run is not None and ended.steps_run == previous.steps_run
    since = ended.steps_since_commit
    return same_run or (since is not None and since == previous.steps_since_commit)


def restarts_repeating(ended: Sequence[EndedAttempt]) -> int:
    """How many of the last attempts in `ended` (oldest first) each failed exactly as the one before it
    (`repeats_exactly`), in a row."""
    count = 0
    for position in range(len(ended) - 1, 0, -1):
        if not repeats_exactly(ended[position], ended[position - 1]):
            break
        count += 1
    return count


def _place(ended: EndedAttempt) -> str:
    """Where an attempt failed, for the rule-5 line: after its first step, else after its last commit."""
    if ended.steps_run is not None:
        place = f"{ended.steps_run} steps after their first step"
    else:
        place = ""
    if ended.steps_since_commit is not None:
        since = f"{ended.steps_since_commit} after their last checkpoint"
        place = f"{place}, {since}" if place else since
    return place


def restarts_used(history: Sequence[EndedAttempt]) -> int:
    """The restarts the job's failures have used up (rule 6: preemptions and interruptions do not)."""
    return sum(1 for h in history if h.end.outcome in _COUNTED)


def finishing(attempt: EndedAttempt, before: Sequence[EndedAttempt]) -> bool:
    """Whether `attempt`, a restart after `before` (oldest first) that reached no new step, was finishing the
    job, not stalling: a training process of the job (in `before` or `attempt`) ended its training loop at
    the job's furthest step (`ended_training_at`: `ettr.training_ended()`, the final
    `CheckpointManager.finish`, `ettr.resilient` when the training function returns, Lightning's and Hugging
    Face's `on_train_end`), and `attempt` reached that step (resumed from it, replayed up to it, or ended its
    own training there). No new step can come: it failed in the job's shutdown (a final save, a publish, the
    teardown, a kill), which rules 3, 5 and `max_restarts` bound. False without that evidence (an
    unmodified script) and for a restart that never got that far (a node that dies during every start-up)."""
    ends = [h.ended_training_at for h in (*before, attempt) if h.ended_training_at is not None]
    reached = attempt.reached_step
    if not ends or reached is None:
        return False
    end = max(ends)
    furthest = max((h.last_step for h in (*before, attempt) if h.last_step is not None), default=None)
    return (furthest is None or end >= furthest) and reached >= end


def restarts_without_progress(ended: Sequence[EndedAttempt]) -> int:
    """How many of the last attempts in `ended` (oldest first) were restarts that reached no step beyond the
    furthest step of every attempt before them (the job's first attempt is not a restart), and were not
    finishing a job whose training had ended (`finishing`: such a restart ends the count)."""
    count = 0
    for position in range(len(ended) - 1, 0, -1):
        attempt = ended[position]
        if attempt.end.outcome is Outcome.INTERRUPTED:
            continue  # stopped by a person: says nothing either way
        if attempt.end.outcome not in _STALLS:
            break
        before = [h.last_step for h in ended[:position] if h.last_step is not None]
        if attempt.last_step is not None:
            new = not before or attempt.last_step > max(before)
        else:
            new = attempt.made_progress and not before
        if new or finishing(attempt, ended[:position]):
            break
        count += 1
    return count


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """The rules in the module docstring."""

    max_restarts: int = 3
    """Restarts after failures before the job gives up (exit 1); job-wide, across invocations."""
    backoff_s: float = 0.5
    """Wait before the first restart that is not at once; it doubles for each further restart in a row that
    reached no new step."""
    max_backoff_s: float = 30.0
    """The longest wait between attempts."""
    max_restarts_without_progress: int = 2
    """Restarts in a row that reach no new step before the job stops (exit 3)."""

    def __post_init__(self) -> None:
        for name in ("max_restarts", "max_restarts_without_progress"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def decide(
        self, ended: EndedAttempt, *, history: Sequence[EndedAttempt] = (), signalled: int | None = None
    ) -> Decision:
        """What follows `ended`, after the job's earlier attempts (`history`, oldest first);
        `signalled`: the signal the supervisor received, if any."""
        outcome = ended.end.outcome
        if outcome is Outcome.COMPLETED:
            return Decision(restart=False, exit_status=EXIT_COMPLETED, why="completed")
        if signalled is not None:
            return Decision(restart=False, exit_status=stopped_status(signalled), why="not restarting")
        found = ended.diagnosis
        previous = history[-1] if history else None
        if (
            previous is not None
            and not ended.made_progress
            and not previous.made_progress
            and found.cause in (Cause.USER, Cause.UNKNOWN)
            and ended.signature == previous.signature
        ):
            code = (
                f"exit status {ended.end.exit_code}" if ended.end.exit_code is not None else "no exit status"
            )
            what = f"{ended.end.exception}, " if ended.end.exception else ""
            when = "after its training ended" if finishing(ended, history) else "before its first step"
            return Decision(
                restart=False,
                exit_status=EXIT_HOPELESS,
                why=f"failed the same way twice {when} ({what}{code}): restarts would not help",
            )
        repeats = restarts_repeating([*history, ended])
        if self.max_restarts_without_progress and repeats >= self.max_restarts_without_progress:
            what = f"{ended.end.exception}" if ended.end.exception else ended.diagnosis.evidence
            return Decision(
                restart=False,
                exit_status=EXIT_HOPELESS,
                why=(
                    f"{repeats} restarts in a row failed as the attempt before them ({what}, {_place(ended)}): "
                    "restarts would not help"
                ),
            )
        stalled = restarts_without_progress([*history, ended])
        if self.max_restarts_without_progress and stalled >= self.max_restarts_without_progress:
            return Decision(
                restart=False,
                exit_status=EXIT_HOPELESS,
                why=f"{stalled} restarts in a row reached no new step: restarts would not help",
            )
        if self.max_restarts == 0:  # asked for no restarts at all: not even after a preemption
            status = EXIT_PREEMPTED if outcome is Outcome.PREEMPTED else EXIT_FAILED
            return Decision(restart=False, exit_status=status, why="not restarting (--max-restarts 0)")
        used = restarts_used(history)
        counted = outcome in _COUNTED
        if counted and used >= self.max_restarts:
            return Decision(restart=False, exit_status=EXIT_FAILED, why="no restarts left")
        wait_s = backoff_wait_s(
            max(stalled, repeats),  # per restart in a row that reached no new step or repeated, not per used
            outcome=outcome,
            made_progress=ended.made_progress,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
            detail=found.detail,
        )
        budget = f"{used + 1} of {self.max_restarts}" if counted else f"a {found.cause.value}: not counted"
        return Decision(restart=True, wait_s=wait_s, why=f"restarting in {wait_s:g} s ({budget})")
