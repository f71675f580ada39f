"""Training that nobody records: processes the job's instrumented process starts with multiprocessing that
step an optimizer without becoming ranks.

pytorch/examples' `mnist_hogwild` shares one model between processes it starts itself
(`model.share_memory()`, `mp.Process(target=train, ...)`, start method `spawn`), and each steps its own
optimizer on it; none joins a process group, so none becomes a rank (`ettr.bootstrap.spawned`), and every
step is in a process that records nothing: under `ettr run` the console said `still no training step after
120 s (cold start: ...)` while both processes trained, and the report booked the whole job as start-up with
the hint that the job "never stepped an optimizer".

Here such a process (one that carries the instrumented process's marker, `ETTR_INSTRUMENTED_PID`, and is not
that process: a rank drops the marker when it becomes one) writes `unrecorded_steps_path` at its first
optimizer step (`watch_steps`: one global post-step hook, which returns at once after its first call: it cannot remove
itself, torch iterates its hooks while it runs). The supervisor's
start-up watch says so at its next line, and the instrumented process records the pids in a MARK
(`UNRECORDED_MARK`) as it exits (`record_at_exit`), from which the report says why ETT is unknown. Their
steps are not counted: without a process group there is no rank to count them for, and no way to know
how many such processes train (the job's ETT stays unknown rather than one process's share).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

from ettr.constants import UNRECORDED_MARK

_handles: list[Any] = []
_noted: list[bool] = []


def watch_steps(optim: ModuleType | None = None) -> None:
    """In a process multiprocessing started under the instrumented process: note its first optimizer step
    unless it became a rank by then. `optim` is `torch.optim.optimizer` (default: the loaded one; nothing
    when torch is not loaded: call again through `when_imported`). Cheap; never raises."""
    try:
        optim = optim if optim is not None else sys.modules.get("torch.optim.optimizer")
        register = getattr(optim, "register_optimizer_step_post_hook", None)
        if register is None or _handles:
            return
        _handles.append(register(_first_step))
    except Exception:
        pass


def _first_step(*_: Any) -> None:
    from ettr.atomic import create_exclusive
    from ettr.run_env import INSTRUMENTED_ENV, RunEnv, unrecorded_steps_path
    from ettr.untrusted import make_dirs_below

    if _noted:
        return  # one look per process (the hook stays: torch iterates its hooks while calling this one)
    _noted.append(True)
    try:
        marker = os.environ.get(INSTRUMENTED_ENV)
        run_env = RunEnv.from_environ(os.environ)
        if marker is None or marker == str(os.getpid()) or run_env is None:
            return  # a rank (it dropped its spawner's marker) or the instrumented process: its steps count
        path = unrecorded_steps_path(run_env.run_dir, run_env.attempt, os.getpid())
        make_dirs_below(run_env.run_dir, path.parent)
        create_exclusive(path, b"", durable=False)
    except Exception:
        pass


def record_at_exit(rec: Any, run_dir: str, attempt: int) -> None:
    """In the instrumented process: at its exit (before the recorder's own exit handler, which was registered
    earlier), record the pids that stepped unrecorded in `attempt`, if any. Never raises."""
    import atexit

    def record() -> None:
        from ettr.run_env import unrecorded_trainers

        try:
            pids = unrecorded_trainers(run_dir, attempt)
            if pids:
                rec.mark(UNRECORDED_MARK, pids=pids)
        except Exception:
            pass

    atexit.register(record)
