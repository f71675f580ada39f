"""ettr: Effective Training Time for PyTorch jobs.

The functions here act on this process's default recorder, which `ettr run` sets up through the
environment; outside a run they record nothing. Importing ettr has no side effects.

    import ettr
    with ettr.phase(ettr.Phase.COMPILE):
        model = torch.compile(model)
    for step in range(start, num_steps):
        train_step()
        ettr.step(step + 1)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ettr.events import Bucket, Event, EventKind, Outcome, Phase

if TYPE_CHECKING:
    from ettr import checkpoint as checkpoint
    from ettr import inplace as inplace
    from ettr.recorder import Recorder

__version__ = "0.1.0"
__all__ = [
    "Bucket",
    "Event",
    "EventKind",
    "Outcome",
    "Phase",
    "checkpoint_committed",
    "init",
    "mark",
    "phase",
    "get_recorder",
    "resilient",
    "resumed_from",
    "step",
    "training_ended",
    "training_started",
]


_LAZY_SUBPACKAGES = ("checkpoint", "inplace")


if not TYPE_CHECKING:  # for mypy the two are plain submodules (above), and a typo stays an error

    def __getattr__(name: str) -> Any:
        """`ettr.inplace.Generation`, `ettr.checkpoint.lease` after a bare `import ettr`, as the docs write
        them: imported on first use (both import torch.distributed, which `import ettr` must not)."""
        if name in _LAZY_SUBPACKAGES:
            import importlib

            return importlib.import_module(f"ettr.{name}")
        raise AttributeError(f"module 'ettr' has no attribute {name!r}")


def get_recorder() -> Recorder:
    """This process's default Recorder (a null one outside an ettr run).

    (Not named `recorder`: that is the `ettr.recorder` module, which would shadow it once imported.)
    """
    from ettr.runtime import get_recorder

    return get_recorder()


def init(run_dir: str | os.PathLike[str], *, job_id: str | None = None) -> Recorder:
    """Record this process into `run_dir` without `ettr run` (see `ettr.runtime.init`)."""
    from ettr.runtime import init as _init

    return _init(run_dir, job_id=job_id)


def resilient(fn: Any = None, *, config: Any = None) -> Any:
    """Run a training function so that a rank's failure restarts it in place (`ettr.inplace.resilient`:
    `ettr.resilient(train)()` or `@ettr.resilient`; `train(gen)` gets an `ettr.inplace.Generation`)."""
    from ettr.inplace import resilient as _resilient

    return _resilient(fn, config=config)


def phase(name: Phase | str, *, step: int | None = None, **data: Any) -> Any:
    """Context manager recording phase `name` (a `Phase` or its string) while the block runs."""
    return get_recorder().phase(name, step=step, **data)


def step(n: int) -> None:
    """Global optimizer step `n` has just completed."""
    get_recorder().step(n)


def training_started() -> None:
    """The training loop begins now."""
    get_recorder().training_started()


def training_ended(step: int | None = None) -> None:
    """The training loop has ended (after `step`; default the last step recorded): a restart that reaches that
    step is finishing the job, not stalling (`ettr.supervisor.policy`, rule 4). Not needed with
    `CheckpointManager.finish`, `ettr.resilient` or the Lightning and Hugging Face callbacks: they say it."""
    get_recorder().training_ended(step)


def resumed_from(step: int | None) -> None:
    """This attempt resumed from the state after `step` (None: from scratch)."""
    get_recorder().resumed_from(step)


def checkpoint_committed(step: int, path: str | os.PathLike[str]) -> None:
    """The checkpoint of `step` at `path` is durable and visible."""
    get_recorder().checkpoint_committed(step, path)


def mark(name: str, **data: Any) -> None:
    """Record anything else worth keeping, by name."""
    get_recorder().mark(name, **data)
