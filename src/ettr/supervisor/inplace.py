"""Restart in place, the agent's side: when a worker of a resilient job fails, ettr's agent keeps the others.

The workers' side is `ettr.inplace` (docs/inplace.md). Under ettr's torchrun agent every worker gets
`ETTR_INPLACE=1` and `ETTR_INPLACE_STORE` (a FileStore in shared memory that outlives any rank, made here once
per supervisor run and removed with the job's memory copies at its end). A worker running `ettr.resilient`
says it has joined attempt A's process group (`inplace_ready_path`), and a failure it survived
(`inplace_failed_path`). `InPlaceCheck` decides, when a worker died or said it failed, whether the attempt
can go on in place: only when every worker still running had joined the attempt (so it is inside the
wrapper, waiting for the next generation) and the attempt has trained (a process of it took its first
step) — a failure before that, at start-up or during an in-place recovery, takes the process restart as
before. (A worker that dies while `train` sets up, before the first step, can leave its peers in a group
formation they do not abandon for the group's whole timeout — the checkpoint manager's `new_group`, 30
minutes in gloo — where a replacement's rendezvous gives up after `rendezvous_timeout_s` and the job
failed; a process restart stops them.) Then the supervisor books the attempt's end and the next attempt (a
recovery of kind `in_place`), starts a replacement for each worker that died (from its warm standby) and
writes the next attempt's number (`announce`), which the survivors wait for.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.run_env import (
    INPLACE_ENV,
    INPLACE_STORE_ENV,
    MEMORY_OWNER_NAME,
    has_trained,
    inplace_failed_path,
    inplace_next_path,
    inplace_ready_path,
    memory_root,
    private_dir_problem,
)
from ettr.untrusted import loads_bounded, make_dirs_below, open_regular

_MARKER_MAX_BYTES = 1 << 16
"""A failure marker is a rank, an error of at most 2,000 characters and a flag: more is not read."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ettr's agent restarts resilient jobs in place (`ETTR_INPLACE=0` in the supervisor's
    environment turns it off: every failure then takes a process restart)."""
    return (os.environ if environ is None else environ).get(INPLACE_ENV, "").strip() != "0"


def store_env(run_dir: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workers' in-place variables: `ETTR_INPLACE=1` and a fresh FileStore for the job's generations, in
    shared memory (in the run directory where there is none), owned by `run_dir` so that the job's end
    removes it (`ettr.run_env.remove_memory_dirs_of_run`)."""
    root = memory_root(environ)
    if root is not None:
        directory = root / f"inplace-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = private_dir_problem(root)
            if problem is not None:  # another user's root: they could swap the store for a file of theirs
                raise PermissionError(problem)
            directory.mkdir(mode=0o700)
            (directory / MEMORY_OWNER_NAME).write_bytes(os.fsencode(os.path.abspath(run_dir)) + b"\n")
        except OSError:
            root = None
    if root is None:
        directory = run_dir / "agent" / "inplace" / f"store-{os.getpid()}-{secrets.token_hex(6)}"
        make_dirs_below(run_dir, directory, mode=0o700)  # never through a symlinked agent/
    return {INPLACE_ENV: "1", INPLACE_STORE_ENV: f"file://{directory / 'store'}"}


@dataclass(frozen=True, kw_only=True)
class InPlace:
    """A failure of the attempt that its other workers survive: the attempt goes on in place."""

    failed_rank: int
    """The rank whose failure it is (the first that died, else the first that said it failed of its own
    error, else the first that said it failed)."""
    returncode: int
    """The failed worker's exit status (negative: the signal); 1 for a failure it survived (`survived`); 0 for
    a worker that left on its own while its peers trained (`left`)."""
    dead: tuple[int, ...]
    """Local ranks whose processes are gone: each gets a replacement."""

    @property
    def left(self) -> bool:
        """The failed rank exited with status 0 while its peers still trained: it left on its own."""
        return bool(self.dead) and self.returncode == 0

    @property
    def survived(self) -> bool:
        """The failed rank raised and its wrapper caught it: no process exited (the books give no exit
        status, and say it was recovered in place)."""
        return not self.dead


class InPlaceCheck:
    """Whether a failure in attempt `attempt` can be recovered in place (see the module docstring)."""

    def __init__(self, run_dir: Path, attempt: int) -> None:
        self.run_dir = run_dir
        self.attempt = attempt

    def joined(self, pid: int) -> bool:
        return inplace_ready_path(self.run_dir, self.attempt, pid).exists()

    def said_failed(self, pid: int) -> bool:
        return inplace_failed_path(self.run_dir, self.attempt, pid).exists()

    def said_own_failure(self, pid: int) -> bool:
        """Whether the worker's marker says the failure was its own error, not a peer's it saw through a
        collective ("Connection closed by peer"). A marker without the field (or unreadable) counts as own."""
        try:
            with os.fdopen(open_regular(inplace_failed_path(self.run_dir, self.attempt, pid)), "rb") as f:
                data = loads_bounded(f.read(_MARKER_MAX_BYTES))  # 1,000 brackets: RecursionError
        except (OSError, ValueError):
            return True
        return not (isinstance(data, dict) and data.get("own") is False)

    def check(self, pids: Sequence[int], codes: Sequence[int | None], dead: Sequence[int]) -> InPlace | None:
        """`pids`/`codes`: per local rank, the worker and its exit status (None: running); `dead`: the ranks
        that failed by exiting. The in-place recovery to run, or None (the process restart, or no failure)."""
        running = [r for r, c in enumerate(codes) if c is None and r not in dead]
        if not running or not all(self.joined(pids[r]) for r in running):
            return None
        if not has_trained(self.run_dir, self.attempt):  # start-up or an in-place recovery not yet done
            return None
        if dead:
            code = codes[dead[0]]
            return InPlace(failed_rank=dead[0], returncode=1 if code is None else code, dead=tuple(dead))
        said = [r for r in running if self.said_failed(pids[r])]
        if not said:
            return None
        left = [r for r, c in enumerate(codes) if c == 0]
        if left:
            # A worker exited 0 while its peers say the attempt failed: it left on its own mid-training (a
            # `sys.exit(0)` inside `train`, a SIGTERM handler's exit: a SystemExit passes through the
            # wrapper). Its peers' "Connection closed by peer" is the echo; it is replaced like a dead one
            # (before: "rank 0 raised", nothing replaced, and the survivor waited 120 s for it in the
            # rendezvous, then gave up).
            return InPlace(failed_rank=left[0], returncode=0, dead=tuple(left))
        # Every rank of a failed generation says so; the failure is the rank's whose own error it was (a
        # peer's "Connection closed by peer" is only the echo), the lowest such rank where several were.
        own = [r for r in said if self.said_own_failure(pids[r])]
        if not own and len(said) < len(running):
            # Only echoes yet, and a running rank that has not said it failed: the failure is that rank's, on
            # its way out (a SystemExit's teardown: DataLoader workers, the group; seconds under load) or not
            # on record yet. Wait for its exit or its marker (before: the echo's rank was booked as the
            # failed one, and the leaving rank was never replaced).
            return None
        said.sort(key=lambda r: r not in own)
        return InPlace(failed_rank=said[0], returncode=1, dead=())

    def stranded(self, pids: Sequence[int], codes: Sequence[int | None]) -> int | None:
        """A running worker that said attempt `attempt` failed where `check` makes no in-place recovery (the
        attempt had not trained, or a running worker had not joined): it waits in the wrapper for a next
        attempt that is never announced, until its rendezvous timeout (120 s), so the failure is the process
        restart's now. The local rank to book (its own error first, else the lowest), or None."""
        running = [r for r, c in enumerate(codes) if c is None]
        said = [r for r in running if self.said_failed(pids[r])]
        if not said:
            return None
        if all(self.joined(pids[r]) for r in running) and has_trained(self.run_dir, self.attempt):
            return None  # `check` recovers it in place
        said.sort(key=lambda r: not self.said_own_failure(pids[r]))
        return said[0]


def announce(run_dir: Path, attempt: int, replaced: Sequence[int]) -> None:
    """Tell the surviving workers that the job goes on in attempt `attempt` (they join it)."""
    path = inplace_next_path(run_dir)
    make_dirs_below(run_dir, path.parent)
    atomic_write(path, json.dumps({"attempt": attempt, "replaced": list(replaced)}).encode(), durable=False)
