"""The looks that saw an attempt's processes gone (`restart.PeerFailureWatch`): which rank failed first, and
when the supervisor first saw a rank gone (the failure instant where no rank recorded one: a SIGKILL)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ettr.causes import EXITED_EARLY, is_collective_error
from ettr.events import Event, EventKind
from ettr.run_env import exited_path

if TYPE_CHECKING:
    from ettr.supervisor.inplace import InPlace


def first_failed_rank(
    looks: Sequence[Sequence[int]], rank_of: Mapping[int, int], failures: Sequence[Event]
) -> int | None:
    """The rank whose failure came first, from the looks that saw processes gone (`classify`'s
    `failed_pids`) and the FAILURE events with an exception the ranks recorded (None: no rank seen gone).

    Ranks seen gone in the same look died between two looks, in an order the look cannot tell (its own order
    is the process tree's). Within it: a rank that recorded an exception of its own (not a broken
    collective) failed first, the earliest of them; then a rank that recorded nothing (killed: by a signal,
    the OOM killer, or a launcher stopping the rest after the first failure); last a rank that died of a
    broken collective, the consequence of another's death. A script's `mp.spawn` whose rank 0 raised and
    whose rank 1 it then terminated, both gone in one look, named rank 1. No rank seen gone (ettr stopped
    the rest at a data loader worker's death): the rank that recorded an exception of its own first."""
    first_failure: dict[int, Event] = {}
    for event in sorted(failures, key=lambda e: e.ts):
        first_failure.setdefault(event.rank, event)

    def order(rank: int) -> tuple[int, float]:
        event = first_failure.get(rank)
        if event is None:
            return (1, 0.0)
        data = event.data or {}
        if is_collective_error(str(data.get("exception")), str(data.get("message") or "")):
            return (2, event.ts)
        return (0, event.ts)

    for look in looks:
        ranks = [rank_of[pid] for pid in look if pid in rank_of]
        if ranks:
            return min(ranks, key=order)  # min is stable: the look's own order breaks ties
    own = [rank for rank in first_failure if order(rank)[0] == 0]
    return min(own, key=order) if own else None


def first_rank_gone_at(
    seen_gone: Sequence[tuple[float, Sequence[int]]], rank_of: Mapping[int, int]
) -> float | None:
    """When the first look that saw a training rank's process gone, one that did not mark a clean exit, was
    taken (`seen_gone`: each look's time and such pids, in the order of the looks): that rank died at or
    before then. None: no such rank seen gone. (A rank that finished first, rank 1 done while rank 0 saved
    the final model and was then SIGKILLed, is not the failure.)"""
    for ts, pids in seen_gone:
        if any(pid in rank_of for pid in pids):
            return ts
    return None


def worker_seen_gone(
    at: float | None, looks: Sequence[Sequence[int]], returncode: int | None, continued: InPlace | None
) -> list[tuple[float, list[int]]]:
    """ettr's agent's `seen_gone`: its failed worker (`looks`) and when the agent saw it end (`at`), where
    it died (a non-zero status; in place: not a raise it lived on from). The failure instant where the
    worker recorded none: a SIGKILLed rank's detection read `?` in the report, though the agent, woken by
    its exit, saw it at once. A worker that exited 0 or lived on is no death; nor is a group with none."""
    code = returncode if continued is None else continued.returncode
    if at is None or not code or (continued is not None and continued.survived):
        return []
    return [(at, list(look)) for look in looks]


def exited_early(
    run_dir: str | os.PathLike[str], attempt: int, ranks: Mapping[int, int], events: Sequence[Event]
) -> str | None:
    """The words that put first a rank that ended without an exception (`run_env.exited_path`, written as its
    Python-level exit is done: the end of its script, a `sys.exit`) before the attempt's first FAILURE, when
    that FAILURE is a broken collective: the peers' `Connection closed by peer` is the early exit's
    consequence (field trial: rank 1 of the DDP tutorial calling `sys.exit(0)` mid-epoch was printed as rank
    0's gloo RuntimeError, `infra (collective)`, and every restart ran at once). None otherwise."""
    failures = sorted((e for e in events if e.kind is EventKind.FAILURE and e.rank >= 0), key=lambda e: e.ts)
    if not failures:
        return None
    data = failures[0].data or {}
    if not is_collective_error(str(data.get("exception")), str(data.get("message") or "")):
        return None
    rank_of = {e.data["pid"]: e.rank for e in events if e.kind is EventKind.PROCESS_START and e.data}
    rank_of.update(ranks)
    ended: list[tuple[float, int]] = []
    for pid, rank in rank_of.items():
        try:
            at = Path(exited_path(run_dir, attempt, pid)).stat().st_mtime
        except (OSError, TypeError, ValueError):
            continue
        if at <= failures[0].ts and rank != failures[0].rank:
            ended.append((at, rank))
    if not ended:
        return None
    return f"rank {min(ended)[1]} {EXITED_EARLY}"
