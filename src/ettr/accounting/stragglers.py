"""Slow ranks: a rank (or a whole node) whose steps are persistently slower than its peers', since when, by
how much, and the time the job lost waiting for it. Pure: no I/O, no clock.

In data-parallel training the ranks meet at every step's gradient sync, so every rank's step takes as long
as the slowest one's: step intervals are the same on every rank, and a slow rank shows as *lateness*, the
time it reaches the sync after its peers. Each rank's STEP carries that arrival as its `value` (the
bootstrap's backward hook, `Recorder.note_arrival`: when the rank's backward pass starts, after its data and
forward); without arrivals (books of another writer, a script outside the bootstrap) the STEP times stand in,
which show a rank that is late *after* the sync, or ranks that do not sync at all. Rules (docs/buckets.md,
"Slow ranks"):

- Per attempt, per step recorded by at least two ranks: a rank's lateness is its arrival minus the median
  arrival of the other ranks. It is *late* at that step when the lateness is at least
  max(`MIN_LATE_S`, `LATE_FRACTION` x the attempt's median step interval).
- A rank straggles over every window of `WINDOW_STEPS` consecutive compared steps in which it is late at
  least `PERSISTENT_FRACTION` of the time; overlapping windows make one episode, from its first late step to
  its last (trimmed to runs of three late steps at both ends). A node straggles when all its ranks (by the host of their PROCESS_START) straggle at once and
  other hosts' ranks do not.
- How much: the median lateness over the episode (`extra_per_step_s`), beside the median step interval
  then (`step_s`). The time lost waiting for it: per step of the episode, the last arrival of the straggling
  ranks minus the last arrival of the others (when positive), summed.
- Only ranks that step together are compared: in data-parallel training no rank can be further than about a
  step ahead of another (it waits at the next sync), so an attempt whose ranks' arrivals at the same step
  number are typically more than `LOCKSTEP_STEPS` median step intervals apart (independent processes that
  never sync, each drifting at its own pace) is not compared, and says so: a drift is no wait. Within a
  compared attempt a step's wait is never more than that step's interval.
- Unknown stays unknown: one rank, or too few steps of the other ranks in the books read (the fleet reads
  only the reference rank's steps of a running job), gives `checked` False and the reason.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ettr.events import Event, EventKind

MIN_LATE_S = 0.002
"""A rank is never late by less than this (clock resolution and scheduling jitter)."""
LATE_FRACTION = 0.10
"""... nor by less than this share of the attempt's median step interval."""
WINDOW_STEPS = 20
"""Consecutive compared steps a straggling window spans: fewer is not 'persistent'."""
PERSISTENT_FRACTION = 0.75
"""Share of a window's steps a rank must be late at for the window to straggle."""
_CONFIRM = 3
"""An episode starts (and ends) at a run of this many late steps."""
LOCKSTEP_STEPS = 2.0
"""Ranks whose arrivals at a step are typically more than this many step intervals apart do not step together."""
_ARRIVAL_SHARE = 0.5
"""Arrivals are used when every compared rank carries one on at least this share of its steps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    """One episode of a rank (or a node's ranks) persistently late at the sync."""

    attempt: int
    ranks: tuple[int, ...]
    host: str | None
    """The host of its ranks (their PROCESS_START), None when not recorded."""
    node: bool
    """True when the ranks are every rank of `host` (the node is the straggler, not one rank)."""
    first_step: int
    last_step: int
    start_ts: float
    """Its arrival at `first_step`: since when."""
    end_ts: float
    until_end: bool
    """The episode lasts to the attempt's last compared step."""
    num_steps: int
    """Compared steps from `first_step` to `last_step`."""
    num_late_steps: int
    extra_per_step_s: float
    """Median lateness behind the other ranks over the episode."""
    step_s: float | None
    """Median step interval over the episode (what every rank's step took, waiting included)."""
    lost_s: float | None
    """Time the job waited for it: per step, its last arrival minus the others' last, summed; None when no
    other rank was compared."""

    @property
    def slower_pct(self) -> float | None:
        """How much longer its steps take than its peers' would: extra / (step - extra), in %."""
        if self.step_s is None or self.step_s - self.extra_per_step_s <= 0:
            return None
        return self.extra_per_step_s / (self.step_s - self.extra_per_step_s) * 100.0

    @property
    def name(self) -> str:
        """`node h2 (ranks 8-15)`, `rank 1 (host h1)`, `ranks 3, 5`."""
        where = f" (host {self.host})" if self.host else ""
        if self.node and self.host:
            return f"node {self.host} ({_ranks(self.ranks)})"
        return f"{_ranks(self.ranks)}{where}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpeed:
    """The job's slow-rank check (`EttReport.rank_speed`)."""

    checked: bool
    """Whether two or more ranks' steps could be compared in at least one attempt."""
    reason: str
    """Why not (`checked` False), else how they were compared."""
    source: str | None
    """`arrival` (each rank's arrival at the gradient sync) or `step` (STEP times); None when not checked."""
    num_ranks: int
    """Most ranks compared in one attempt."""
    num_compared_steps: int
    stragglers: tuple[Straggler, ...]

    @property
    def lost_s(self) -> float | None:
        """Time the job waited for stragglers, all episodes; None when not checked."""
        if not self.checked:
            return None
        return math.fsum(s.lost_s for s in self.stragglers if s.lost_s is not None)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


class _Attempt:
    """The arrivals of one attempt's ranks at each step compared, in step order."""

    def __init__(self, index: int, rank_events: Mapping[int, Sequence[Event]]) -> None:
        self.index = index
        self.hosts: dict[int, str] = {}
        steps: dict[int, dict[int, tuple[float, float | None]]] = {}
        for rank, events in rank_events.items():
            if rank < 0:
                continue
            mine: dict[int, tuple[float, float | None]] = {}
            for e in events:
                if e.kind is EventKind.STEP and e.step is not None and e.step not in mine:
                    mine[e.step] = (e.ts, _arrival(e))
                elif e.kind is EventKind.PROCESS_START and isinstance(e.data, Mapping):
                    host = e.data.get("host")
                    if isinstance(host, str) and host:
                        self.hosts.setdefault(rank, host)
            if mine:
                steps[rank] = mine
        self.ranks = sorted(steps)
        with_arrivals = all(
            sum(1 for _, a in steps[r].values() if a is not None) >= _ARRIVAL_SHARE * len(steps[r])
            for r in self.ranks
        )
        self.source = "arrival" if with_arrivals else "step"
        common = sorted(k for k in set().union(*(set(v) for v in steps.values())) if _count(steps, k) >= 2)
        self.steps: list[int] = []
        self.arrivals: list[dict[int, float]] = []
        for k in common:
            row = {}
            for r in self.ranks:
                found = steps[r].get(k)
                if found is not None:
                    ts, arrival = found
                    if not with_arrivals:
                        row[r] = ts
                    elif arrival is not None:  # never an arrival beside a STEP time: that would read as late
                        row[r] = arrival
            if len(row) >= 2:
                self.steps.append(k)
                self.arrivals.append(row)
        reference = steps[self.ranks[0]] if self.ranks else {}
        self.step_ts = {k: ts for k, (ts, _) in reference.items()}  # the lowest rank's STEP times
        self.step_s = _median_interval(self.step_ts, sorted(self.step_ts))


def _median_interval(step_ts: Mapping[int, float], steps: Sequence[int]) -> float | None:
    """Median interval between consecutive step numbers among `steps` (ascending)."""
    intervals = [
        step_ts[b] - step_ts[a]
        for a, b in zip(steps, steps[1:], strict=False)
        if b == a + 1 and a in step_ts and b in step_ts and step_ts[b] >= step_ts[a]
    ]
    return statistics.median(intervals) if intervals else None


def _interval_at(a: _Attempt, i: int) -> float | None:
    """The reference rank's interval into the i-th compared step, when it recorded that step and the one before."""
    k = a.steps[i]
    if k in a.step_ts and k - 1 in a.step_ts and a.step_ts[k] >= a.step_ts[k - 1]:
        return a.step_ts[k] - a.step_ts[k - 1]
    return None


def _median_without(ordered: Sequence[float], position: int) -> float:
    """The median of `ordered` (sorted, at least two values) without the value at `position`: O(1)."""
    n = len(ordered) - 1

    def at(i: int) -> float:
        return ordered[i] if i < position else ordered[i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2.0


def _count(steps: Mapping[int, Mapping[int, object]], k: int) -> int:
    return sum(1 for v in steps.values() if k in v)


def _arrival(e: Event) -> float | None:
    value = e.value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    # An arrival comes before its STEP, within the step: anything else is not an arrival.
    return float(value) if e.ts - 86_400.0 <= value <= e.ts else None


def rank_speed(attempts: Mapping[int, Mapping[int, Sequence[Event]]]) -> RankSpeed:
    """The slow-rank check of a job from each attempt's events by rank (rules in the module docstring)."""
    found: list[Straggler] = []
    num_ranks, num_compared, sources = 0, 0, set()
    apart = 0
    for index in sorted(attempts):
        by_rank = attempts[index]
        stepping = [r for r, evs in by_rank.items() if r >= 0 and any(e.kind is EventKind.STEP for e in evs)]
        if len(stepping) < 2:  # nothing to compare: skip the work (most jobs have one rank)
            continue
        a = _Attempt(index, by_rank)
        if len(a.ranks) < 2:
            continue
        num_ranks = max(num_ranks, len(a.ranks))
        if len(a.steps) < WINDOW_STEPS:
            continue
        if not _in_lockstep(a):
            apart += 1
            continue
        num_compared += len(a.steps)
        sources.add(a.source)
        found += _stragglers(a)
    if not num_compared:
        if num_ranks < 2:
            why = "one rank: no peers to compare"
        elif apart:
            why = (
                "the ranks do not step together (their steps drift apart by more than "
                f"{LOCKSTEP_STEPS:g} step intervals: no gradient sync between them), so no rank waits for another"
            )
        else:
            why = (
                f"fewer than {WINDOW_STEPS} steps recorded by two or more ranks in every attempt (a short job, "
                "or the other ranks' steps are not in the events read)"
            )
        return RankSpeed(
            checked=False, reason=why, source=None, num_ranks=num_ranks, num_compared_steps=0, stragglers=()
        )
    source = "arrival" if sources == {"arrival"} else "step"
    how = (
        "by each rank's arrival at the gradient sync (its backward pass starting)"
        if source == "arrival"
        else "by the time each rank recorded each step"
    )
    return RankSpeed(
        checked=True,
        reason=f"{num_ranks} ranks compared over {num_compared} steps {how}",
        source=source,
        num_ranks=num_ranks,
        num_compared_steps=num_compared,
        stragglers=tuple(sorted(found, key=lambda s: (s.start_ts, s.ranks))),
    )


def _in_lockstep(a: _Attempt) -> bool:
    """Whether the attempt's ranks step together: the median spread of their arrivals at a step is within
    `LOCKSTEP_STEPS` median step intervals (unknown interval: assumed together, as before)."""
    if a.step_s is None or a.step_s <= 0:
        return True
    spreads = [max(row.values()) - min(row.values()) for row in a.arrivals]
    return statistics.median(spreads) <= LOCKSTEP_STEPS * a.step_s


def _stragglers(a: _Attempt) -> list[Straggler]:
    threshold = max(MIN_LATE_S, LATE_FRACTION * a.step_s) if a.step_s is not None else MIN_LATE_S
    late: dict[int, list[bool]] = {r: [False] * len(a.arrivals) for r in a.ranks}
    for i, row in enumerate(a.arrivals):
        ordered = sorted((t, r) for r, t in row.items())
        values = [t for t, _ in ordered]
        for position, (t, r) in enumerate(ordered):
            late[r][i] = t - _median_without(values, position) >= threshold
    episodes = {r: _episodes(flags) for r, flags in late.items()}
    groups = _group_by_node(a, episodes)
    return [_straggler(a, ranks, first, last, late, host, node) for ranks, first, last, host, node in groups]


def _episodes(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """(first, last) indices of each run of straggling windows, trimmed to late steps."""
    n = len(flags)
    prefix = [0]
    for f in flags:
        prefix.append(prefix[-1] + int(f))
    need = PERSISTENT_FRACTION * WINDOW_STEPS
    spans: list[list[int]] = []
    for start in range(0, n - WINDOW_STEPS + 1):
        if prefix[start + WINDOW_STEPS] - prefix[start] >= need:
            end = start + WINDOW_STEPS - 1
            if spans and start <= spans[-1][1] + 1:
                spans[-1][1] = end
            else:
                spans.append([start, end])
    out = []
    for first, last in spans:
        # From the first late step that begins a run of `_CONFIRM` late steps to the last that ends one, so a
        # lone late step of noise next to the episode does not move its start or end.
        starts = [i for i in range(first, last - _CONFIRM + 2) if all(flags[i : i + _CONFIRM])]
        ends = [i for i in range(first + _CONFIRM - 1, last + 1) if all(flags[i - _CONFIRM + 1 : i + 1])]
        if starts and ends:
            first, last = starts[0], ends[-1]
        else:
            while not flags[first]:
                first += 1
            while not flags[last]:
                last -= 1
        out.append((first, last))
    return out


def _group_by_node(
    a: _Attempt, episodes: Mapping[int, list[tuple[int, int]]]
) -> list[tuple[tuple[int, ...], int, int, str | None, bool]]:
    """Episodes as (ranks, first, last, host, is_node): a host all of whose ranks straggle at overlapping
    steps (while some other host's ranks do not) is one node episode; the rest stay per rank."""
    by_host: dict[str, list[int]] = {}
    for r in a.ranks:
        if r in a.hosts:
            by_host.setdefault(a.hosts[r], []).append(r)
    out: list[tuple[tuple[int, ...], int, int, str | None, bool]] = []
    claimed: set[tuple[int, int, int]] = set()
    for host, ranks in by_host.items():
        if len(by_host) < 2 or len(ranks) < 2 or not all(episodes[r] for r in ranks):
            continue
        for first, last in episodes[ranks[0]]:
            overlapping = [[(b, e) for b, e in episodes[r] if b <= last and e >= first] for r in ranks]
            if all(overlapping):
                spans = [s for found in overlapping for s in found]
                out.append((tuple(ranks), min(b for b, _ in spans), max(e for _, e in spans), host, True))
                claimed.update(
                    (r, b, e) for r, found in zip(ranks, overlapping, strict=True) for b, e in found
                )
    for r, spans in episodes.items():
        for first, last in spans:
            if (r, first, last) not in claimed:
                out.append(((r,), first, last, a.hosts.get(r), False))
    return out


def _straggler(
    a: _Attempt,
    ranks: tuple[int, ...],
    first: int,
    last: int,
    late: Mapping[int, list[bool]],
    host: str | None,
    node: bool,
) -> Straggler:
    members = set(ranks)
    lateness, lost = [], []
    for i in range(first, last + 1):
        row = a.arrivals[i]
        mine = [t for r, t in row.items() if r in members]
        others = [t for r, t in row.items() if r not in members]
        if mine and others:
            lateness.append(max(mine) - statistics.median(others))
            wait = max(0.0, max(mine) - max(others))
            interval = _interval_at(a, i)
            lost.append(wait if interval is None else min(wait, interval))  # no wait outlasts its step
    start = a.arrivals[first].get(ranks[0], min(a.arrivals[first].values()))
    end = a.arrivals[last].get(ranks[0], max(a.arrivals[last].values()))
    step_s = _median_interval(a.step_ts, a.steps[first : last + 1])
    return Straggler(
        attempt=a.index,
        ranks=ranks,
        host=host,
        node=node,
        first_step=a.steps[first],
        last_step=a.steps[last],
        start_ts=start,
        end_ts=end,
        until_end=last >= len(a.steps) - 1 - WINDOW_STEPS // 4,
        num_steps=last - first + 1,
        num_late_steps=sum(1 for i in range(first, last + 1) if any(late[r][i] for r in ranks)),
        extra_per_step_s=statistics.median(lateness) if lateness else 0.0,
        step_s=step_s,
        lost_s=math.fsum(lost) if lost else None,
    )
