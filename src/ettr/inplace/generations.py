"""Who numbers a resilient job's generations, and how a rank learns that the one it ran is over.

A generation is one incarnation of the job's process group: the ranks that joined it, until a failure.
Two authorities number them:

* `AgentGenerations` — under ettr's agent (`ETTR_INPLACE=1`): a generation is an attempt of the job's books.
  The agent notices a rank's death itself (its process exits) and a failure a rank survived from the
  rank's marker (`ettr.run_env.inplace_failed_path`); it books the next attempt, starts a replacement for
  a rank that died, and writes the attempt's number (`inplace_next_path`), which the others wait for.
* `StoreGenerations` — anywhere else: a counter in the job's store. The first rank to see generation g fail
  moves it to g + 1; the others learn it from the store. A rank that dies is not replaced (nobody starts
  one): its peers wait in vain, time out and exit, and the launcher restarts the job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from ettr.atomic import create_exclusive
from ettr.run_env import inplace_failed_path, inplace_next_path, inplace_ready_path
from ettr.untrusted import make_dirs_below, read_json_file

_GENERATION_KEY = "ettr/inplace/generation"
_POLL_S = 0.002
MAX_NEXT_BYTES = 1 << 20
"""The agent's answer names an attempt and the ranks replaced; more than this is not one it wrote."""


class GenerationTimeout(RuntimeError):
    """No next generation came in time: the in-place restart is given up."""


class Generations(Protocol):
    """The numbering of a job's generations (see the module docstring)."""

    def first(self) -> int:
        """The generation this process joins first (a replacement joins the current one)."""
        ...

    def joined(self, generation: int) -> None:
        """This process now runs generation `generation` inside the wrapper."""
        ...

    def moved_on(self, generation: int) -> bool:
        """Whether a generation after `generation` has begun (cheap; polled while waiting)."""
        ...

    def after_failure(
        self, generation: int, *, rank: int, error: str, timeout_s: float, own: bool = True
    ) -> int:
        """Generation `generation` failed here (`error`; `own`: this rank's own failure, not a peer's seen
        through a collective): the next one this process joins. Raises GenerationTimeout when none comes
        within `timeout_s`."""
        ...


class StoreGenerations:
    """Generations counted in the job's store (anywhere but under ettr's agent)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def first(self) -> int:
        return int(self.store.add(_GENERATION_KEY, 0))

    def joined(self, generation: int) -> None:
        pass

    def moved_on(self, generation: int) -> bool:
        return int(self.store.add(_GENERATION_KEY, 0)) > generation

    def after_failure(
        self, generation: int, *, rank: int, error: str, timeout_s: float, own: bool = True
    ) -> int:
        # The first rank to report generation g's failure moves the counter on; the others see it moved.
        if int(self.store.add(f"ettr/inplace/{generation}/failed", 1)) == 1:
            self.store.add(_GENERATION_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while True:
            current = int(self.store.add(_GENERATION_KEY, 0))
            if current > generation:
                return current
            if time.monotonic() > deadline:
                raise GenerationTimeout(f"generation {generation + 1} did not begin in {timeout_s:g} s")
            time.sleep(_POLL_S)


class AgentGenerations:
    """Generations are the attempts ettr's agent books (`ETTR_INPLACE=1`)."""

    def __init__(self, run_dir: Path, attempt: int, *, pid: int | None = None) -> None:
        self.run_dir = run_dir
        self.attempt = attempt
        self.pid = os.getpid() if pid is None else pid

    def first(self) -> int:
        return self.attempt

    def joined(self, generation: int) -> None:
        self.attempt = generation
        path = inplace_ready_path(self.run_dir, generation, self.pid)
        make_dirs_below(self.run_dir, path.parent)  # never through a symlinked agent/
        try:
            create_exclusive(path, b"", durable=False)
        except FileExistsError:
            pass

    def next_attempt(self) -> int | None:
        """The attempt the agent last said the job continues in (None: it has said none)."""
        try:  # never a wait in a FIFO, never 10 GB read, never a RecursionError from a forged nesting
            data = read_json_file(inplace_next_path(self.run_dir), MAX_NEXT_BYTES)
        except (OSError, ValueError):
            return None
        attempt = data.get("attempt") if isinstance(data, dict) else None
        return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None

    def moved_on(self, generation: int) -> bool:
        found = self.next_attempt()
        return found is not None and found > generation

    def after_failure(
        self, generation: int, *, rank: int, error: str, timeout_s: float, own: bool = True
    ) -> int:
        if not self.moved_on(generation):  # the agent may know already (a peer died); else tell it
            path = inplace_failed_path(self.run_dir, generation, self.pid)
            make_dirs_below(self.run_dir, path.parent)
            try:
                marker = {"rank": rank, "error": error[:2000], "own": own}  # `own`: whom the agent blames
                create_exclusive(path, json.dumps(marker), durable=False)
            except FileExistsError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.next_attempt()
            if found is not None and found > generation:
                return found
            if time.monotonic() > deadline:
                raise GenerationTimeout(
                    f"ettr's agent started no attempt after {generation} in {timeout_s:g} s"
                )
            time.sleep(_POLL_S)
