"""The discrete-event model of one job's life, and many seeded runs of it.

An attempt starts (the first after scheduling and hardware set-up, later ones after a relaunch gap), goes
through its start-up components, then trains: `interval_s` of training, a save that blocks the loop
`blocking_s` (plus any wait for the previous persist), again. A save becomes durable `persist_s` after its
blocking ends; an interruption rolls the job back to the newest durable save. Interruptions are node
failures (any time the job holds its nodes: start-up, training, relaunch) and scheduler preemptions (the
job saves and exits when it handles them). Evaluation inside the loop (`eval_s_per_train_s`) stretches the
training: every training second comes with its evaluation, kept or lost with it. Between interruptions the
timeline is arithmetic, so a run costs one loop iteration per interruption, not per step or save. Each run
ends in the report's own buckets.
Pure: no I/O, no clock; randomness only from the seeded generators it is given.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from ettr.events import Bucket
from ettr.simulate.params import JobParams, RecoveryKind
from ettr.simulate.streams import EventStream, failure_source, preemption_source

_BUCKET_INDEX = {bucket: i for i, bucket in enumerate(Bucket)}
_B = _BUCKET_INDEX

MAX_INTERRUPTIONS = 2_000_000
"""A run that needs more interruptions than this to finish is refused (it would not finish in any time)."""


@dataclass(frozen=True, kw_only=True)
class ScriptedFault:
    """One interruption of a replayed job, at the same point of its attempt as in the measured run."""

    preemption: bool
    """A scheduler preemption (SIGTERM); else a failure."""
    in_startup: bool
    """It came before the attempt's first step."""
    after_s: float
    """Seconds into the attempt's start-up (`in_startup`), else training seconds of progress the attempt
    made (its steps since it resumed, times the step time)."""
    tail_s: float = 0.0
    """Seconds from the interruption (the attempt's last step) to its end: detection, or the exit save."""
    saved_on_exit: bool = False
    """The attempt committed a checkpoint of its last step before exiting (save-then-exit)."""
    ends_job: bool = False
    """The job ended after it (its restarts were used up, or it was not requeued)."""
    kept_s: float | None = None
    """Training seconds of the attempt's progress its newest commit held when it was interrupted (measured:
    its saves came when they came, an `auto` interval's included); None: the model's fixed interval decides."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """One simulated run, in the report's terms."""

    buckets_s: tuple[float, ...]
    """Seconds per bucket, in the order of `ettr.events.Bucket`; they sum to `wall_s`."""
    wall_s: float
    num_failures: int
    """Attempts that did not complete (failures and preemptions), as the report counts them."""
    num_preemptions: int
    tts_s: float | None
    ttr_s: tuple[float, ...]
    kept_s: float
    """Training seconds of progress kept at the end."""

    @property
    def ett_pct(self) -> float:
        return 100.0 * self.buckets_s[_B[Bucket.EFFECTIVE_TRAINING]] / self.wall_s if self.wall_s else 0.0


def _first_save_s(params: JobParams, resumed_s: float) -> float:
    """Training seconds from an attempt's training start to its first save."""
    interval = params.interval_s
    if not params.interval_global:
        return interval
    k = math.floor(resumed_s / interval + 1e-9) + 1
    return k * interval - resumed_s


def _split(elapsed_s: float, first_s: float, params: JobParams) -> tuple[float, float, float]:
    """Training seconds, blocking seconds, and durable progress (training seconds) `elapsed_s` of wall time
    after the training start of an attempt whose first save comes after `first_s` of training."""
    if elapsed_s <= first_s:
        return elapsed_s, 0.0, 0.0
    interval, save = params.interval_s, params.save_cost_s
    cycle = interval + save
    j = math.floor((elapsed_s - first_s) / cycle)
    r = elapsed_s - first_s - j * cycle
    if r < save:
        train, block = first_s + j * interval, j * save + r
    else:
        train, block = first_s + j * interval + (r - save), (j + 1) * save
    # Save i (1-based) ends its blocking at first + (i - 1) * cycle + save and is durable persist later.
    durable_at = elapsed_s - first_s - save - params.persist_s
    num_durable = math.floor(durable_at / cycle + 1e-12) + 1 if durable_at >= 0 else 0
    kept = first_s + (num_durable - 1) * interval if num_durable > 0 else 0.0
    return train, block, min(kept, train)


def _wall_for_progress(progress_s: float, first_s: float, params: JobParams) -> float:
    """Wall seconds after the training start at which the attempt has trained `progress_s` (saves taken
    at points of progress strictly before it included)."""
    if progress_s <= first_s:
        return progress_s
    num_saves = math.ceil((progress_s - first_s) / params.interval_s - 1e-12)
    return progress_s + max(num_saves, 1) * params.save_cost_s


class _Run:
    """The state of one run as its loop goes: the clock, the buckets, progress kept, attempts."""

    __slots__ = (
        "acc", "allocated", "attempt", "failures", "first_pieces", "gap", "horizon", "kept", "kind_ways", "kinds",
        "later_pieces", "next_pieces", "next_total", "num_failures", "num_preemptions", "params", "pending",
        "preemptions", "script", "t", "train_end", "tts", "ttrs", "work",
    )  # fmt: skip

    def __init__(
        self,
        params: JobParams,
        failures: EventStream,
        preemptions: EventStream,
        script: tuple[ScriptedFault, ...] | None,
        kinds: KindDraws | None = None,
    ) -> None:
        self.params, self.failures, self.preemptions, self.script = params, failures, preemptions, script
        self.kinds = kinds if params.recovery_kinds and script is None else None
        self.kind_ways = [_kind_way(params, k) for k in params.recovery_kinds]
        self.acc = [0.0] * len(_BUCKET_INDEX)
        self.horizon = math.inf if params.duration_s is None else params.duration_s
        self.train_end = self.horizon - params.shutdown_s
        self.work = math.inf if params.work_s is None else params.work_s
        self.first_pieces = _pieces(params, True, 0.0)
        self.later_pieces = {g: _pieces(params, False, g) for g in (_gap(params, False), _gap(params, True))}
        # Scheduling and hardware set-up: no failures counted before the job holds its nodes.
        self.acc[_B[Bucket.SCHEDULING]] = self.t = min(params.scheduling_s, self.horizon)
        self.allocated = self.t
        self.acc[_B[Bucket.HARDWARE_SETUP]] = min(params.hardware_setup_s, self.horizon - self.t)
        self.t += self.acc[_B[Bucket.HARDWARE_SETUP]]
        self.kept, self.attempt, self.gap = 0.0, 0, 0.0
        self.next_pieces, self.next_total = self.first_pieces, params.first_startup.total_s
        self.num_failures = self.num_preemptions = 0
        self.tts: float | None = None
        self.ttrs: list[float] = []
        self.pending: list[float] = []

    def next_fault(self, first_save_s: float | None, gap_s: float) -> tuple[float, bool, float, bool]:
        return _next_fault(
            self.params,
            self.script,
            self.attempt,
            self.failures,
            self.preemptions,
            self.t,
            first_save_s,
            gap_s,
        )

    def interrupted(self, preempted: bool) -> bool:
        """Book an interruption that ended the attempt at `t`; True when the job ends with it (replay)."""
        self.num_failures += 1
        self.num_preemptions += preempted
        self.pending.append(self.t)
        self.gap = _gap(self.params, preempted)
        self.next_pieces, self.next_total = self.later_pieces[self.gap], self.params.restart_startup.total_s
        if not preempted and self.kinds is not None:
            chosen = self.kinds.draw()
            if chosen is not None:  # a failure this kind recovers, at its own cost
                self.gap, self.next_pieces, self.next_total = self.kind_ways[chosen]
        self.attempt += 1
        if self.script is not None and self.script[self.attempt - 1].ends_job:
            self.acc[_B[Bucket.SHUTDOWN]] += self.params.shutdown_s
            return True
        return False

    def start_up(self) -> bool | None:
        """The relaunch gap (later attempts) and start-up components: None when training starts, else
        whether the job ends (True: the window closed or a replay ended; False: interrupted, go on)."""
        params, acc, first = self.params, self.acc, self.attempt == 0
        pieces = self.first_pieces if first else self.next_pieces
        total = params.first_startup.total_s if first else self.next_total
        startup_end = self.t + self.gap + total
        at, preempted, detection_s, _saved = self.next_fault(None, self.gap)
        stop = min(at, self.horizon)
        if stop < startup_end:
            _spend(acc, pieces, stop - self.t)
            if stop >= self.horizon:
                return True
            _spend_last(acc, pieces, stop - self.t, detection_s)  # detection: still start-up time
            self.t = stop + detection_s
            return self.interrupted(preempted)
        _spend(acc, pieces, startup_end - self.t)
        self.t = startup_end
        if self.tts is None:
            self.tts = self.t - self.allocated
        self.ttrs.extend(self.t - d for d in self.pending)
        self.pending.clear()
        return None

    def train(self) -> bool:
        """Train from the training start at `t` until the job ends (True) or is interrupted (False)."""
        params, acc = self.params, self.acc
        first = _first_save_s(params, self.kept)
        need = self.work - self.kept
        finish = self.t + _wall_for_progress(need, first, params) if need < math.inf else math.inf
        finish = min(finish, self.train_end)
        stop, preempted, tail, saved = self.next_fault(first, 0.0)
        if stop >= finish:
            train, block, _durable = _split(max(0.0, finish - self.t), first, params)
            acc[_B[Bucket.EFFECTIVE_TRAINING]] += train
            acc[_B[Bucket.CHECKPOINT_BLOCKING]] += block
            self.kept += train
            self.t = max(self.t, finish)
            shutdown = min(params.shutdown_s, self.horizon - self.t)
            acc[_B[Bucket.SHUTDOWN]] += shutdown
            self.t += shutdown
            return True
        train, block, durable = _split(stop - self.t, first, params)
        acc[_B[Bucket.CHECKPOINT_BLOCKING]] += block
        if preempted and saved:
            # Save-then-exit: the save's blocking, then the wait for its persist before the process exits,
            # which the report counts as the failed attempt's tail (wasted progress).
            exit_s = tail if self.script is not None else params.blocking_s + params.persist_s
            exit_blocking = min(params.blocking_s, exit_s)
            acc[_B[Bucket.EFFECTIVE_TRAINING]] += train
            acc[_B[Bucket.CHECKPOINT_BLOCKING]] += exit_blocking
            acc[_B[Bucket.WASTED_PROGRESS]] += exit_s - exit_blocking
            self.kept += train
            self.t = stop + exit_s
        else:
            fault = self.script[self.attempt] if self.script is not None else None
            if fault is not None and fault.kept_s is not None:
                durable = min(train, fault.kept_s)  # a replay: what the job's own saves had kept
            acc[_B[Bucket.EFFECTIVE_TRAINING]] += durable
            acc[_B[Bucket.WASTED_PROGRESS]] += train - durable + tail
            self.kept += durable
            self.t = stop + tail
        return self.interrupted(preempted)

    def result(self) -> RunResult:
        return RunResult(
            buckets_s=tuple(self.acc),
            wall_s=math.fsum(self.acc),
            num_failures=self.num_failures,
            num_preemptions=self.num_preemptions,
            tts_s=self.tts,
            ttr_s=tuple(self.ttrs),
            kept_s=self.kept,
        )


def simulate_run(
    params: JobParams,
    failures: EventStream,
    preemptions: EventStream,
    script: tuple[ScriptedFault, ...] | None = None,
    kinds: KindDraws | None = None,
) -> RunResult:
    """One run of the job. With `script` the interruptions are those (one per attempt, in order) and the
    streams are not used: a replay of a measured job. `kinds`: which recovery kind each failure gets
    (`params.recovery_kinds`; None: every failure costs `restart_s`)."""
    stretch = 1.0 + params.eval_s_per_train_s
    if stretch != 1.0:
        params, script = _with_evaluation(params, script, stretch)
    run = _Run(params, failures, preemptions, script, kinds)
    while run.t < run.horizon:
        if run.num_failures > MAX_INTERRUPTIONS:
            raise ValueError(
                f"a run passed {MAX_INTERRUPTIONS:,} interruptions: the job makes (almost) no progress at "
                "this failure rate; lower the rate or the restart cost"
            )
        ended = run.start_up()
        if ended is None:
            ended = run.train()
        if ended:
            break
    result = run.result()
    return result if stretch == 1.0 else _split_evaluation(result, stretch)


def _with_evaluation(
    params: JobParams, script: tuple[ScriptedFault, ...] | None, stretch: float
) -> tuple[JobParams, tuple[ScriptedFault, ...] | None]:
    """The job with each training second stretched by its evaluation (progress, the interval and the
    scripted faults' progress in the same stretched seconds); `_split_evaluation` takes it apart again."""
    stretched = replace(
        params,
        eval_s_per_train_s=0.0,
        step_s=params.step_s * stretch,
        interval_s=params.interval_s * stretch,
        work_s=None if params.work_s is None else params.work_s * stretch,
    )
    if script is not None:
        script = tuple(
            f
            if f.in_startup
            else replace(
                f, after_s=f.after_s * stretch, kept_s=None if f.kept_s is None else f.kept_s * stretch
            )
            for f in script
        )
    return stretched, script


def _split_evaluation(result: RunResult, stretch: float) -> RunResult:
    """Kept stretched training -> effective training and evaluation (lost evaluation stays wasted)."""
    buckets = list(result.buckets_s)
    kept = buckets[_B[Bucket.EFFECTIVE_TRAINING]]
    buckets[_B[Bucket.EFFECTIVE_TRAINING]] = kept / stretch
    buckets[_B[Bucket.EVALUATION]] += kept - kept / stretch
    return replace(result, buckets_s=tuple(buckets), kept_s=result.kept_s / stretch)


def _pieces(params: JobParams, first: bool, gap: float) -> tuple[tuple[int, float], ...]:
    """(bucket index, seconds) of an attempt's way to its first step: the relaunch gap, then start-up."""
    startup = params.first_startup if first else params.restart_startup
    return ((_B[Bucket.RESTART], gap),) + tuple((_B[Bucket(n)], s) for n, s in startup.components())


def _kind_way(params: JobParams, kind: RecoveryKind) -> tuple[float, tuple[tuple[int, float], ...], float]:
    """(relaunch gap, pieces, start-up total) of one recovery of `kind`."""
    gap, startup = params.kind_restart(kind)
    pieces = ((_B[Bucket.RESTART], gap),) + tuple((_B[Bucket(n)], s) for n, s in startup.components())
    return gap, pieces, startup.total_s


class KindDraws:
    """Which recovery kind each failure of one run gets, in order: a uniform draw from a generator of its
    own, against the kinds' cumulative shares (None: no kind covers it; it costs `restart_s`)."""

    def __init__(self, kinds: tuple[RecoveryKind, ...], rng: np.random.Generator) -> None:
        self._bounds = list(itertools.accumulate(k.share for k in kinds))
        self._rng = rng

    def draw(self) -> int | None:
        u = float(self._rng.random())
        for index, bound in enumerate(self._bounds):
            if u < bound:
                return index
        return None


def kind_draws(params: JobParams, *, seed: int, run_index: int) -> KindDraws | None:
    """The kind draws of run `run_index` of the seeded family `seed` (None without recovery kinds)."""
    if not params.recovery_kinds:
        return None
    stream = np.random.SeedSequence([seed, run_index]).spawn(3)[2]  # the third after failures, preemptions
    return KindDraws(params.recovery_kinds, np.random.default_rng(stream))


def _gap(params: JobParams, preempted: bool) -> float:
    if preempted and params.preempt_requeue_s is not None:
        return params.preempt_requeue_s
    return params.restart_gap_s


def _spend(acc: list[float], pieces: tuple[tuple[int, float], ...], seconds: float) -> None:
    """Give `seconds` to the start-up pieces in order (a start-up cut short fills only its first ones)."""
    for index, length in pieces:
        if seconds <= 0:
            return
        used = min(length, seconds)
        acc[index] += used
        seconds -= used


def _spend_last(
    acc: list[float], pieces: tuple[tuple[int, float], ...], into_s: float, extra_s: float
) -> None:
    """Give `extra_s` (detection) to the start-up piece that was running `into_s` seconds in."""
    if extra_s <= 0:
        return
    start = 0.0
    chosen = pieces[0][0]
    for index, length in pieces:
        if length > 0 and start <= into_s:
            chosen = index
        start += length
    acc[chosen] += extra_s


def _next_fault(
    params: JobParams,
    script: tuple[ScriptedFault, ...] | None,
    attempt: int,
    failures: EventStream,
    preemptions: EventStream,
    t: float,
    first_save_s: float | None,
    gap_s: float,
) -> tuple[float, bool, float, bool]:
    """(time, is a preemption, detection seconds, saves on exit) of the attempt's next interruption after
    `t`; `first_save_s` is None in start-up (then `t` is the end of the previous attempt, `gap_s` before the
    attempt's start), else `t` is its training start."""
    if script is not None:
        if attempt >= len(script):
            return math.inf, False, 0.0, False
        fault = script[attempt]
        if first_save_s is None:
            if not fault.in_startup:
                return math.inf, False, 0.0, False
            return t + gap_s + fault.after_s, fault.preemption, fault.tail_s, fault.saved_on_exit
        if fault.in_startup:  # already fired in start-up
            return math.inf, False, 0.0, False
        at = t + _wall_for_progress(fault.after_s, first_save_s, params)
        return at, fault.preemption, fault.tail_s, fault.saved_on_exit
    failure_at = failures.next_after(t)
    preempt_at = preemptions.next_after(t)
    if preempt_at < failure_at:
        return preempt_at, True, 0.0, params.handles_preemption
    return failure_at, False, params.detection_s, False


def run_generators(seed: int, run_index: int) -> tuple[np.random.Generator, np.random.Generator]:
    """The (failures, preemptions) generators of one run: independent of how many runs there are."""
    failures, preemptions = np.random.SeedSequence([seed, run_index]).spawn(2)
    return np.random.default_rng(failures), np.random.default_rng(preemptions)


def seeded_streams(params: JobParams, *, seed: int, run_index: int) -> tuple[EventStream, EventStream]:
    """The (failures, preemptions) streams of run `run_index` of the seeded family `seed`."""
    failure_rng, preempt_rng = run_generators(seed, run_index)
    hint = params.duration_s if params.duration_s is not None else 2.0 * (params.work_s or 0.0)
    failures = EventStream(
        failure_source(
            failure_rng,
            num_nodes=params.num_nodes,
            per_node_day=params.failures_per_node_day,
            shape=params.weibull_shape,
        ),
        hint,
    )
    return failures, EventStream(preemption_source(preempt_rng, params.preemptions_per_day), hint)


def simulate_seeded(params: JobParams, *, seed: int, run_index: int) -> RunResult:
    """Run `run_index` of the seeded family `seed` (the same failure times for any policy of the job)."""
    kinds = kind_draws(params, seed=seed, run_index=run_index)
    return simulate_run(params, *seeded_streams(params, seed=seed, run_index=run_index), kinds=kinds)
