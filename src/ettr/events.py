"""The event model: what training processes and the supervisor append to the ledger.

Every other module imports this one; it imports nothing of ettr's. Events are small frozen
records; phases are a closed `StrEnum` that maps onto the contract's closed set of buckets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

SCHEMA_VERSION = 1
"""Version of the stored event layout (the ledger refuses to read a newer one)."""

FAILURE_NOTE_PREFIX = "ettr: "
"""An exception note (PEP 678) that ettr's hooks added (`exc.add_note`): a FAILURE's message carries it."""


def failure_message(message: str, notes: Any = ()) -> str:
    """A FAILURE's `message`: the exception's, then each of ettr's notes on a line of its own, as
    `[ettr: ...]` (`split_failure_message` takes them apart again)."""
    own = [
        note.removeprefix(FAILURE_NOTE_PREFIX).replace("\n", " ")
        for note in notes
        if isinstance(note, str) and note.startswith(FAILURE_NOTE_PREFIX)
    ]
    return "\n".join([message, *(f"[{FAILURE_NOTE_PREFIX}{note}]" for note in own)]) if own else message


_RERAISED = re.compile(r"\ACaught (\w+) in (.+?)\.\nOriginal Traceback \(most recent call last\):\n")


def reraised_message(text: str) -> str:
    """An exception's message, where torch re-raised one from a DataLoader worker (or its pin-memory thread)
    as `Caught ValueError in DataLoader worker process 0.` and the worker's whole traceback: the worker's own
    words and where it raised, `corrupt sample 1500: cannot decode record (raised in DataLoader worker process
    0)`. The console line and the report showed only that first sentence (the cut to 500 characters fell
    inside torch's frames), never what the dataset said. Any other message is returned as it is."""
    found = _RERAISED.match(text)
    if found is None:
        return text
    name, where = found.group(1), found.group(2)
    last = next((line for line in reversed(text.splitlines()) if line.strip() and not line[0].isspace()), "")
    said = last.removeprefix(f"{name}:").strip() if last.startswith((f"{name}:", name)) else last.strip()
    if said == name:
        said = ""
    return f"{said} (raised in {where})" if said else f"raised in {where}"


def split_failure_message(message: str) -> tuple[str, list[str]]:
    """A FAILURE's message as (the exception's message, ettr's notes as `[ettr: ...]`)."""
    lines = message.split("\n")
    notes: list[str] = []
    while lines and lines[-1].startswith(f"[{FAILURE_NOTE_PREFIX}") and lines[-1].endswith("]"):
        notes.insert(0, lines.pop())
    return "\n".join(lines), notes


def clip_failure_message(message: str, limit: int = 500) -> str:
    """A FAILURE's message with the exception's part cut to `limit` characters and ettr's notes kept."""
    text, notes = split_failure_message(message)
    return "\n".join([text[:limit], *(note[:limit] for note in notes)])


SUPERVISOR_RANK = -1
"""`Event.rank` of events written by the supervisor rather than a training process."""


class Bucket(StrEnum):
    """The closed set of wall-time buckets of `shared/CONTRACT.md`; they partition wall time."""

    SCHEDULING = "scheduling"
    HARDWARE_SETUP = "hardware_setup"
    INIT = "init"
    COMPILE = "compile"
    RESTORE = "restore"
    DATA_WAIT = "data_wait"
    EFFECTIVE_TRAINING = "effective_training"
    CHECKPOINT_BLOCKING = "checkpoint_blocking"
    WASTED_PROGRESS = "wasted_progress"
    RESTART = "restart"
    SHUTDOWN = "shutdown"
    OTHER = "other"
    EVALUATION = "evaluation"  # added in the third wave: evaluation/validation passes in kept work


class Phase(StrEnum):
    """What a training process can say it is doing. Each phase maps to one bucket (`PHASE_BUCKET`)."""

    # Trainer-init sub-stages (the source article's names).
    DEVICE_INIT = "device_init"
    PROCESS_GROUP_INIT = "process_group_init"
    PREPROC_CREATION = "preproc_creation"
    TRAIN_MODULE_CREATION = "train_module_creation"
    INIT_PLUGINS = "init_plugins"
    PRE_TRAIN = "pre_train"
    GET_FIRST_BATCH_DATA = "get_first_batch_data"
    # Generic start-up phases.
    INIT = "init"
    COMPILE = "compile"
    RESTORE = "restore"
    DATA_WAIT = "data_wait"
    # Checkpointing: the loop is blocked (copy/stage), or waits for the previous save to finish;
    # the persist runs in the background and overlaps training (reported raw, never a bucket).
    CHECKPOINT_BLOCKING = "checkpoint_blocking"
    CHECKPOINT_WAIT = "checkpoint_wait"
    CHECKPOINT_PERSIST = "checkpoint_persist"
    # End of the job and anything else.
    SHUTDOWN = "shutdown"
    PUBLISH = "publish"
    EVAL = "eval"  # evaluation / validation passes (books into `evaluation`)
    OTHER = "other"


PHASE_BUCKET: Mapping[Phase, Bucket | None] = {
    Phase.DEVICE_INIT: Bucket.INIT,
    Phase.PROCESS_GROUP_INIT: Bucket.INIT,
    Phase.PREPROC_CREATION: Bucket.INIT,
    Phase.TRAIN_MODULE_CREATION: Bucket.INIT,
    Phase.INIT_PLUGINS: Bucket.INIT,
    Phase.PRE_TRAIN: Bucket.INIT,
    Phase.GET_FIRST_BATCH_DATA: Bucket.DATA_WAIT,
    Phase.INIT: Bucket.INIT,
    Phase.COMPILE: Bucket.COMPILE,
    Phase.RESTORE: Bucket.RESTORE,
    Phase.DATA_WAIT: Bucket.DATA_WAIT,
    Phase.CHECKPOINT_BLOCKING: Bucket.CHECKPOINT_BLOCKING,
    Phase.CHECKPOINT_WAIT: Bucket.CHECKPOINT_BLOCKING,
    Phase.CHECKPOINT_PERSIST: None,  # overlapped with training: raw duration only
    Phase.SHUTDOWN: Bucket.SHUTDOWN,
    Phase.PUBLISH: Bucket.SHUTDOWN,
    Phase.EVAL: Bucket.EVALUATION,
    Phase.OTHER: Bucket.OTHER,
}


class EventKind(StrEnum):
    """What happened. `Event` fields used by each kind are listed beside it."""

    # Written by the supervisor (rank = SUPERVISOR_RANK).
    JOB_SUBMITTED = "job_submitted"  # ts = submission time
    JOB_ALLOCATED = "job_allocated"  # ts = allocation time
    SUPERVISOR_START = "supervisor_start"  # data: pid, host, command, max_restarts
    ATTEMPT_START = "attempt_start"  # attempt; data: pid, command
    ATTEMPT_END = "attempt_end"  # attempt; data: outcome, exit_code, signal, reason, ...
    JOB_END = "job_end"  # data: exit_status
    # Written by training processes (rank >= 0).
    PROCESS_START = "process_start"  # data: pid, host, world_size, local_rank, supervisor_pid
    PHASE_BEGIN = "phase_begin"  # phase; step optional
    PHASE_END = "phase_end"  # phase; value = begin ts (so an END alone is a complete span)
    STEP = "step"  # step = the global optimizer step just completed
    TRAINING_START = "training_start"  # explicit: the training loop begins now
    RESUMED = "resumed"  # step = step the attempt resumed from (its state is after that step)
    CHECKPOINT_COMMIT = "checkpoint_commit"  # step; data: path — durable and visible
    CHECKPOINT_ERROR = "checkpoint_error"  # step; data: path, error
    RECOMPILE = "recompile"  # data: reason, code
    FAILURE = "failure"  # data: exception, message — seen inside the process before it died
    MARK = "mark"  # data: name, ... — anything else worth keeping (collective audit, ...)


URGENT_KINDS = frozenset(
    {EventKind.ATTEMPT_END, EventKind.JOB_END, EventKind.FAILURE, EventKind.CHECKPOINT_COMMIT}
)
"""Kinds that are flushed to the ledger at once rather than within the next second."""


class Outcome(StrEnum):
    """How an attempt ended (the contract's closed set)."""

    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"
    HUNG = "hung"
    INTERRUPTED = "interrupted"  # stopped by the user (SIGINT / Ctrl-C): neither a failure nor a preemption
    # Given by the accounting only, never recorded: an attempt without an end, the last of a job without one.
    RUNNING = "running"  # its supervisor is alive: the attempt is still running
    UNKNOWN = "unknown"  # its supervisor was lost (or cannot be checked): how it ends is not known yet


@dataclass(frozen=True, slots=True)
class Event:
    """One ledger record. `ts` is Unix time in seconds (`time.time()`)."""

    kind: EventKind
    ts: float
    attempt: int = 0
    rank: int = 0
    phase: Phase | None = None
    step: int | None = None
    value: float | None = None
    data: Mapping[str, Any] | None = None
