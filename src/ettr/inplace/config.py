"""How a resilient job restarts in place: `InPlaceConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class InPlaceConfig:
    """What `ettr.resilient` does when a rank fails."""

    max_restarts: int = 3
    """In-place restarts this process takes part in before it gives up and exits with the failure (a
    process restart follows under `ettr run`). Under ettr's agent its `--max-restarts` also counts them."""
    rendezvous_timeout_s: float = 120.0
    """How long a generation waits for every rank to join it (a replacement's start-up included) before
    the in-place restart is given up (the process then exits: a process restart follows)."""
    collective_timeout_s: float = 300.0
    """The timeout of the process groups the wrapper makes: a collective blocked longer fails. A peer that
    died or failed is noticed at once (its connections close); this bounds the wait for a peer that hangs
    without the supervisor's hang watchdog killing it."""
    release_wait_s: float = 10.0
    """How long a failed generation's teardown waits for what still holds its process group to let go:
    a background thread of it, such as an async checkpoint's persist that `train` did not wait for (it ends
    once the groups are destroyed). Still held after it: the in-place restart is given up (the process
    exits; a process restart follows)."""
    backend: str | None = None
    """The process group's backend: `gloo`, `nccl`; None: `nccl` where CUDA is available, else `gloo`."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.release_wait_s >= 0 and math.isfinite(self.release_wait_s)):
            raise ValueError(
                f"release_wait_s must be a finite number of seconds >= 0, got {self.release_wait_s}"
            )
        for name in ("rendezvous_timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.backend is not None and self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}")
