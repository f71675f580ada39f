"""The ETT accounting: a job's events in, its Effective Training Time report out.

Pure math: no I/O, no clock reads (`now` is a parameter). Every instant of wall time goes to exactly one
bucket of `ettr.events.Bucket` by the rules of docs/buckets.md; the renderers live in `ettr.report`.
"""

from ettr.accounting.causes import Cause, Detail, FailureCause
from ettr.accounting.compute import Loss, classify, compute, unrecorded_pids
from ettr.accounting.liveness import JobState, OpenJob, counts_as_failure
from ettr.accounting.model import (
    AttemptReport,
    CheckpointCommit,
    CheckpointFailure,
    EttReport,
    Recompile,
    Recovery,
    Segment,
    TtsWindow,
)
from ettr.accounting.slowdown import PersistSlowdown, StepSlowdown
from ettr.accounting.slowsteps import SlowSteps, Warmup
from ettr.accounting.steptime import StepTime
from ettr.accounting.stragglers import RankSpeed, Straggler
from ettr.accounting.timeline import PRECEDENCE
from ettr.accounting.window import DEFAULT_WINDOW_S, EttWindow

__all__ = [
    "DEFAULT_WINDOW_S",
    "EttWindow",
    "RankSpeed",
    "SlowSteps",
    "Straggler",
    "Warmup",
    "AttemptReport",
    "Cause",
    "Detail",
    "CheckpointCommit",
    "CheckpointFailure",
    "EttReport",
    "FailureCause",
    "JobState",
    "Loss",
    "OpenJob",
    "PRECEDENCE",
    "PersistSlowdown",
    "Recompile",
    "Recovery",
    "Segment",
    "StepSlowdown",
    "StepTime",
    "TtsWindow",
    "classify",
    "compute",
    "counts_as_failure",
    "unrecorded_pids",
]
