"""What to do next when a report has nothing to show: a job that recorded no training step says why it might
not have (one line each), instead of a silent "ETT 0.0% | idle 100.0%"."""

from __future__ import annotations

from collections.abc import Sequence

from ettr.accounting import EttReport
from ettr.events import Event, EventKind


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
