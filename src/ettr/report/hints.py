"""What to do next when a report has nothing to show: a job that recorded no training step says why it might
not have (one line each), instead of a silent "ETT 0.0% | idle 100.0%"."""

from __future__ import annotations

from collections.abc import Sequence

from ettr.accounting import EttReport
from ettr.events import Event, EventKind, Phase


def no_step_hints(events: Sequence[Event], report: EttReport) -> list[str]:
    """Lines for a job none of whose attempts recorded a training step (empty when one did)."""
    if any(a.last_step is not None for a in report.attempts) or any(e.kind is EventKind.STEP for e in events):
        return []
    start = next((e for e in events if e.kind is EventKind.SUPERVISOR_START and e.data), None)
    data = start.data if start is not None and start.data else {}
    if data.get("auto") is False:
        return [
            "no training step was recorded: with --no-auto ettr sees only what the script says; call "
            "ettr.step(n) after each optimizer step (docs/supervisor.md), or run without --no-auto"
        ]
    if not any(e.rank >= 0 for e in events):
        if data.get("launcher") == "other":
            return [
                "no training step was recorded, and no process of the job reported anything: ettr instruments "
                "the python and torchrun processes the command starts (behind a shell wrapper too, as long as "
                "they get its environment: env -i, sudo, ssh or a container cut them off); did it start one, "
                "and with ETTR_* and PYTHONPATH passed on?"
            ]
        return [
            "no training step was recorded, and no process of the job reported anything (a script run "
            "outside `ettr run` records only after ettr.init(RUN_DIR))"
        ]
    if report.attempts and all(a.failure for a in report.attempts):
        return []  # every attempt failed before training: the failures say why
    return [
        "no training step was recorded: ettr counts a step at each torch.optim optimizer step (or ettr.step(n), "
        "or a Lightning/HF callback); a job that never stepped an optimizer shows all its time as start-up"
    ]


def torn_checkpoint_hints(events: Sequence[Event]) -> list[str]:
    """A line for each checkpoint that attempts restored although its last save, in an earlier attempt, began
    but never committed: the process ended mid-save (killed, preempted past its grace), so the files there may
    be partial. Frameworks that resume from "the newest checkpoint directory" (Hugging Face's
    `get_last_checkpoint`, a glob for the highest step) pick such a torn one; the restore then fails the same
    way each attempt (`ettr run` stops: restarts would not help), or resumes from half a state.

    Paths come from the RESTORE phase's `path` (the Lightning and Hugging Face callbacks) and the
    CHECKPOINT_BLOCKING phase's `path`; a save counts as committed by its CHECKPOINT_COMMIT or its
    `checkpoint_file` mark (a second file of one checkpoint). Only the saves of the ranks that commit count
    (every rank of a DDP job times its part of a save; rank 0 alone commits, and a slower rank's save can
    begin after that commit): the lowest saving rank when no commit was recorded at all."""
    ordered = sorted(events, key=lambda e: e.ts)
    saves = [e for e in ordered if e.kind is EventKind.PHASE_BEGIN and e.phase is Phase.CHECKPOINT_BLOCKING]
    committers = {e.rank for e in ordered if e.kind is EventKind.CHECKPOINT_COMMIT}
    committers = committers or {min((e.rank for e in saves), default=0)}
    # path -> the CHECKPOINT_BLOCKING begin of its latest save not yet committed
    saving: dict[str, Event] = {}
    last_commit: Event | None = None
    # (path, the save's ts) -> the save, the last commit before it, the attempts that restored it
    torn: dict[tuple[str, float], tuple[Event, Event | None, list[int]]] = {}
    for e in ordered:
        path = e.data.get("path") if e.data else None
        if not isinstance(path, str) or not path:
            continue
        if e.kind is EventKind.PHASE_BEGIN and e.phase is Phase.CHECKPOINT_BLOCKING:
            if e.rank in committers:
                saving[path] = e
        elif e.kind is EventKind.CHECKPOINT_COMMIT or (
            e.kind is EventKind.MARK and e.data is not None and e.data.get("name") == "checkpoint_file"
        ):
            saving.pop(path, None)
            if e.kind is EventKind.CHECKPOINT_COMMIT:
                last_commit = e
        elif (
            e.kind in (EventKind.PHASE_BEGIN, EventKind.PHASE_END) and e.phase is Phase.RESTORE
        ):  # a span too
            save = saving.get(path)
            if save is None or save.attempt >= e.attempt:
                continue  # committed, never saved by this job, or a save of this attempt still in progress
            _, _, attempts = torn.setdefault((path, save.ts), (save, last_commit, []))
            if e.attempt not in attempts:
                attempts.append(e.attempt)
    lines = []
    for (path, _), (save, commit, attempts) in torn.items():
        who = f"attempt {attempts[0]}" if len(attempts) == 1 else f"attempts {', '.join(map(str, attempts))}"
        at = f" at step {save.step}" if save.step is not None else ""
        last = (
            f"; the last committed checkpoint before it: {commit.data.get('path')} (step {commit.step})"
            if commit is not None and commit.data
            else "; no checkpoint had committed before it"
        )
        lines.append(
            f"{who} restored {path}, whose save{at} in attempt {save.attempt} never completed (the process ended "
            f"mid-save): its files may be partial{last}. If the restore fails the same way each attempt, move "
            "the torn checkpoint aside and requeue"
        )
    return lines
