"""Many seeded runs of the model at once: `ettr.simulate.model`'s loop with every run advanced together, one
round of numpy array operations per interruption instead of one Python iteration per interruption per run.

The answers are the model's, run by run: each run draws its failure and preemption times from the same
seeded streams and asks them the same questions in the same order as `model.simulate_seeded` would, and
every step of the loop (start-up pieces, the arithmetic of saves between interruptions, rollback to the
newest durable save, save-then-exit, detection, the window's end) is the same formula on arrays
(tests/test_simulate_batch.py checks them against each other, run by run). Replays (scripted faults) stay
with the scalar loop. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ettr.events import Bucket
from ettr.simulate.model import MAX_INTERRUPTIONS, _with_evaluation, kind_draws, seeded_streams
from ettr.simulate.params import JobParams
from ettr.simulate.streams import EventStream

_B = {bucket: i for i, bucket in enumerate(Bucket)}
_PIECE_COLUMNS = np.array(
    [_B[Bucket.RESTART], _B[Bucket.INIT], _B[Bucket.COMPILE], _B[Bucket.RESTORE], _B[Bucket.DATA_WAIT]]
)
"""The buckets of an attempt's way to its first step, in order: the relaunch gap, then the start-up."""
_ET, _CB, _WP, _SD = (
    _B[Bucket.EFFECTIVE_TRAINING],
    _B[Bucket.CHECKPOINT_BLOCKING],
    _B[Bucket.WASTED_PROGRESS],
    _B[Bucket.SHUTDOWN],
)


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    """Every run of a batch, one row (or entry) per run, in run order."""

    buckets_s: np.ndarray
    """(runs, buckets): seconds per bucket in the order of `ettr.events.Bucket`."""
    wall_s: np.ndarray
    num_failures: np.ndarray
    num_preemptions: np.ndarray
    tts_s: np.ndarray
    """NaN where a run never started training."""
    ttr_sum_s: np.ndarray
    """Sum of a run's times to recover (the mean over all recoveries is sum / count over the runs)."""
    ttr_count: np.ndarray
    kept_s: np.ndarray


class _Streams:
    """The interruption times of every run as rows of one array (padded with +inf), each with a pointer to
    the first time not yet passed; a row that runs out asks its run's `EventStream` for the next block with
    the query time that the scalar loop would have asked, so both draw the same numbers."""

    def __init__(self, streams: list[EventStream], t0: float) -> None:
        self._streams = streams
        blocks = [s.block_after(t0) for s in streams]
        self._endless = np.array([b is None for b in blocks])
        width = max([len(b) for b in blocks if b is not None] + [1])
        self.times = np.full((len(streams), width), np.inf)
        self.length = np.zeros(len(streams), dtype=np.int64)
        for run, block in enumerate(blocks):
            if block is not None:
                self.times[run, : len(block)] = block
                self.length[run] = len(block)
        self.length[self._endless] = np.iinfo(np.int64).max  # never runs out: no source, no events
        self.pointer = np.zeros(len(streams), dtype=np.int64)
        self.never = bool(self._endless.all())

    def next_after(self, runs: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For each of `runs` (run indices), its first time strictly after its `t` (inf: never)."""
        if self.never:
            return np.full(len(runs), np.inf)
        pointer = self.pointer[runs]
        values = self.times[runs, np.minimum(pointer, self.times.shape[1] - 1)]
        while True:
            out = pointer >= self.length[runs]
            if out.any():
                for k in np.flatnonzero(out):
                    self._refill(int(runs[k]), float(t[k]))
                pointer[out] = 0
                values = self.times[runs, pointer]
            behind = values <= t
            if not behind.any():
                break
            pointer += behind
            values = self.times[runs, np.minimum(pointer, self.times.shape[1] - 1)]
        self.pointer[runs] = pointer
        return values

    def _refill(self, run: int, t: float) -> None:
        block = self._streams[run].block_after(t)
        assert block is not None  # an endless row never runs out
        if len(block) > self.times.shape[1]:
            wider = np.full((self.times.shape[0], len(block)), np.inf)
            wider[:, : self.times.shape[1]] = self.times
            self.times = wider
        self.times[run, :] = np.inf
        self.times[run, : len(block)] = block
        self.length[run] = len(block)


class _Model:
    """The model's arithmetic on arrays (see `ettr.simulate.model`, whose scalar functions these mirror)."""

    def __init__(self, params: JobParams) -> None:
        self.params = params
        self.interval = params.interval_s
        self.save = params.save_cost_s
        self.cycle = self.interval + self.save
        self.persist = params.persist_s

    def first_save_s(self, kept: np.ndarray) -> np.ndarray:
        """`model._first_save_s`: training seconds from an attempt's training start to its first save."""
        if not self.params.interval_global:
            return np.full_like(kept, self.interval)
        k = np.floor(kept / self.interval + 1e-9) + 1
        return k * self.interval - kept

    def split(self, elapsed: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`model._split`: (training, blocking, durable progress) `elapsed` seconds after a training start."""
        save, interval, cycle = self.save, self.interval, self.cycle
        early = elapsed <= first
        j = np.floor((elapsed - first) / cycle)
        r = elapsed - first - j * cycle
        in_save = r < save
        train = np.where(in_save, first + j * interval, first + j * interval + (r - save))
        block = np.where(in_save, j * save + r, (j + 1) * save)
        durable_at = elapsed - first - save - self.persist
        num_durable = np.where(durable_at >= 0, np.floor(durable_at / cycle + 1e-12) + 1, 0.0)
        kept = np.minimum(np.where(num_durable > 0, first + (num_durable - 1) * interval, 0.0), train)
        return (
            np.where(early, elapsed, train),
            np.where(early, 0.0, block),
            np.where(early, 0.0, kept),
        )

    def wall_for_progress(self, progress: np.ndarray, first: np.ndarray) -> np.ndarray:
        """`model._wall_for_progress`: wall seconds after the training start to `progress` of training."""
        with np.errstate(invalid="ignore"):
            num_saves = np.ceil((progress - first) / self.interval - 1e-12)
        wall = progress + np.maximum(num_saves, 1.0) * self.save
        return np.where(progress <= first, progress, wall)


def simulate_batch(params: JobParams, *, seed: int, runs: int) -> BatchResult:
    """Runs 0 .. runs-1 of the seeded family `seed`: run i equals `model.simulate_seeded(params, seed=seed,
    run_index=i)`. Raises ValueError when a run passes `MAX_INTERRUPTIONS`, as the scalar loop does.

    Evaluation inside the loop (`eval_s_per_train_s`) is handled as the scalar loop handles it: the job's
    training seconds stretched by it, then the kept stretch split into effective training and evaluation
    (before, this engine, which runs from 64 runs on, left evaluation out and counted it as training)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    stretch = 1.0 + params.eval_s_per_train_s
    if stretch == 1.0:
        return _simulate_batch(params, seed=seed, runs=runs)
    stretched, _ = _with_evaluation(params, None, stretch)
    result = _simulate_batch(stretched, seed=seed, runs=runs)
    buckets = result.buckets_s.copy()
    kept = buckets[:, _B[Bucket.EFFECTIVE_TRAINING]].copy()
    buckets[:, _B[Bucket.EFFECTIVE_TRAINING]] = kept / stretch
    buckets[:, _B[Bucket.EVALUATION]] += kept - kept / stretch
    return replace(result, buckets_s=buckets, kept_s=result.kept_s / stretch)


def _simulate_batch(params: JobParams, *, seed: int, runs: int) -> BatchResult:
    p = params
    model = _Model(p)
    horizon = math.inf if p.duration_s is None else p.duration_s
    train_end = horizon - p.shutdown_s
    work = math.inf if p.work_s is None else p.work_s
    detection_s = p.detection_s
    exit_s = p.blocking_s + p.persist_s  # a save-then-exit: its blocking, then its persist
    exit_blocking = min(p.blocking_s, exit_s)
    # An attempt's way to its first step, by kind: 0 the first attempt, 1 after a failure (the relaunch gap),
    # 2 after a preemption (the requeue).
    # 3 + k: after a failure recovered by recovery kind k (`JobParams.recovery_kinds`, at its own cost).
    requeue_s = p.preempt_requeue_s if p.preempt_requeue_s is not None else p.restart_gap_s
    ways = [p.kind_restart(k) for k in p.recovery_kinds]
    gaps = np.array([0.0, p.restart_gap_s, requeue_s, *(gap for gap, _ in ways)])
    startup_totals = np.array(
        [p.first_startup.total_s, p.restart_startup.total_s, p.restart_startup.total_s]
        + [startup.total_s for _, startup in ways]
    )
    first_parts = [s for _, s in p.first_startup.components()]
    later_parts = [s for _, s in p.restart_startup.components()]
    pieces_by_kind = np.array(
        [[0.0, *first_parts], [gaps[1], *later_parts], [gaps[2], *later_parts]]
        + [[gap, *(s for _, s in startup.components())] for gap, startup in ways]
    )
    draws = [d for i in range(runs) if (d := kind_draws(p, seed=seed, run_index=i)) is not None]
    starts_by_kind = np.cumsum(pieces_by_kind, axis=1) - pieces_by_kind

    # Scheduling and hardware set-up: the same for every run; no failures before the job holds its nodes.
    acc0 = np.zeros(len(_B))
    acc0[_B[Bucket.SCHEDULING]] = t0 = min(p.scheduling_s, horizon)
    allocated = t0
    acc0[_B[Bucket.HARDWARE_SETUP]] = min(p.hardware_setup_s, horizon - t0)
    t0 += acc0[_B[Bucket.HARDWARE_SETUP]]

    streams = [seeded_streams(p, seed=seed, run_index=i) for i in range(runs)]
    failures, preemptions = _Streams([f for f, _ in streams], t0), _Streams([q for _, q in streams], t0)

    # Results, by run; and the state of the runs still going (`ids`: their run indices). Buckets are rows.
    out_acc = np.zeros((len(_B), runs))
    out_started = np.zeros((len(gaps), runs))
    out_kept = np.zeros(runs)
    out_failures = np.zeros(runs, dtype=np.int64)
    out_preempts = np.zeros(runs, dtype=np.int64)
    out_tts = np.full(runs, np.nan)
    out_ttr_sum = np.zeros(runs)
    out_ttr_count = np.zeros(runs, dtype=np.int64)

    ids = np.arange(runs)
    acc = np.zeros((len(_B), runs))
    started = np.zeros((len(gaps), runs))  # start-ups completed, by kind: their pieces are booked at the end
    t = np.full(runs, t0)
    kept = np.zeros(runs)
    kind = np.zeros(runs, dtype=np.int64)
    num_failures = np.zeros(runs, dtype=np.int64)
    num_preempts = np.zeros(runs, dtype=np.int64)
    tts = np.full(runs, np.nan)
    pending_count = np.zeros(runs, dtype=np.int64)
    pending_sum = np.zeros(runs)
    ttr_sum = np.zeros(runs)
    ttr_count = np.zeros(runs, dtype=np.int64)

    while len(ids):
        if num_failures.max() > MAX_INTERRUPTIONS:
            raise ValueError(
                f"a run passed {MAX_INTERRUPTIONS:,} interruptions: the job makes (almost) no progress at "
                "this failure rate; lower the rate or the restart cost"
            )
        ended = t >= horizon  # the loop's own condition: the window closed at the last interruption

        # -- start-up: the relaunch gap (later attempts) and the start-up components, in order
        # (`model._Run.start_up`).
        startup_end = t + gaps[kind] + startup_totals[kind]
        failure_at = failures.next_after(ids, t)
        preempt_at = preemptions.next_after(ids, t)
        preempted = preempt_at < failure_at
        stop = np.minimum(np.where(preempted, preempt_at, failure_at), horizon)
        cut = (stop < startup_end) & ~ended
        interrupted = np.zeros(len(ids), dtype=bool)
        if cut.any():  # a start-up cut short fills its first pieces; detection goes to the running one
            rows = np.flatnonzero(cut)
            pieces, starts = pieces_by_kind[kind[rows]], starts_by_kind[kind[rows]]
            into = stop[rows] - t[rows]
            acc[_PIECE_COLUMNS[:, None], rows] += np.clip(into[:, None] - starts, 0.0, pieces).T
            closed = stop[rows] >= horizon
            ended[rows[closed]] = True
            rows, pieces, starts, into = rows[~closed], pieces[~closed], starts[~closed], into[~closed]
            detection = np.where(preempted[rows], 0.0, detection_s)
            running = (pieces > 0) & (starts <= into[:, None])
            chosen = np.where(running, np.arange(pieces.shape[1]), 0).max(axis=1)
            acc[_PIECE_COLUMNS[chosen], rows] += detection
            t[rows] = stop[rows] + detection
            interrupted[rows] = True
        trains = ~cut & ~ended
        was_preempted = preempted & interrupted

        # -- training, for the runs whose start-up finished: until the job ends or the next interruption
        # (`model._Run.train`).
        if trains.any():
            # The runs that train: usually all of them (a slice: views, no gathers), else their indices.
            tr: slice | np.ndarray = slice(None) if trains.all() else np.flatnonzero(trains)
            started[kind[tr], np.arange(len(ids))[tr]] += 1.0
            t_tr = startup_end[tr]
            tts_tr = tts[tr]
            tts[tr] = np.where(np.isnan(tts_tr), t_tr - allocated, tts_tr)
            ttr_sum[tr] += pending_count[tr] * t_tr - pending_sum[tr]
            ttr_count[tr] += pending_count[tr]
            pending_count[tr] = 0
            pending_sum[tr] = 0.0

            kept_tr = kept[tr]
            first_save = model.first_save_s(kept_tr)
            need = work - kept_tr
            if work < math.inf:
                finish = np.minimum(t_tr + model.wall_for_progress(need, first_save), train_end)
            else:
                finish = np.full(len(t_tr), train_end)
            # The next interruptions after the training start: the ones found after the previous attempt's end
            # (the start-up did not reach them, so they are later), asked again only where one fell exactly on
            # the training start: the streams see the same questions as in the scalar loop.
            failure_at, preempt_at = failure_at[tr], preempt_at[tr]
            for stream, found in ((failures, failure_at), (preemptions, preempt_at)):
                again = found <= t_tr
                if again.any():
                    found[again] = stream.next_after(ids[tr][again], t_tr[again])
            preempted_tr = preempt_at < failure_at
            at = np.where(preempted_tr, preempt_at, failure_at)
            finishes = at >= finish
            elapsed = np.where(finishes, np.maximum(0.0, finish - t_tr), at - t_tr)
            train, block, durable = model.split(elapsed, first_save)
            acc[_CB, tr] += block
            # The job ends: everything trained is kept, then the shutdown (within the window). Interrupted:
            # a handled preemption saves then exits (nothing lost); else back to the last durable save, the
            # rest (and the detection) wasted.
            saves = ~finishes & preempted_tr & p.handles_preemption
            rolls = ~finishes & ~saves
            gained = np.where(rolls, durable, train)
            acc[_ET, tr] += gained
            kept[tr] = kept_tr + gained
            tail = np.where(preempted_tr, 0.0, detection_s)
            acc[_CB, tr] += np.where(saves, exit_blocking, 0.0)
            acc[_WP, tr] += np.where(
                saves, exit_s - exit_blocking, np.where(rolls, train - durable + tail, 0.0)
            )
            t_end = np.maximum(t_tr, finish)
            shutdown = np.where(finishes, np.minimum(p.shutdown_s, horizon - t_end), 0.0)
            acc[_SD, tr] += shutdown
            t[tr] = np.where(finishes, t_end + shutdown, at + np.where(saves, exit_s, tail))
            ended[tr] |= finishes
            interrupted[tr] = ~finishes
            was_preempted[tr] = ~finishes & preempted_tr

        # -- an interruption ends the attempt: the next one starts after the relaunch gap (or the requeue).
        num_failures += interrupted
        num_preempts += was_preempted
        pending_count += interrupted
        pending_sum += np.where(interrupted, t, 0.0)
        kind = np.where(interrupted, np.where(was_preempted, 2, 1), kind)
        if draws:  # each failure's recovery kind, drawn in the run's order as the scalar loop does
            for row in np.flatnonzero(interrupted & ~was_preempted):
                chosen = draws[ids[row]].draw()
                if chosen is not None:
                    kind[row] = 3 + chosen

        if ended.any():
            done, ids_done = np.flatnonzero(ended), ids[ended]
            out_acc[:, ids_done] = acc[:, done]
            out_started[:, ids_done] = started[:, done]
            out_kept[ids_done] = kept[done]
            out_failures[ids_done] = num_failures[done]
            out_preempts[ids_done] = num_preempts[done]
            out_tts[ids_done] = tts[done]
            out_ttr_sum[ids_done] = ttr_sum[done]
            out_ttr_count[ids_done] = ttr_count[done]
            keep = ~ended
            ids, acc, started, t, kept, kind = (
                ids[keep],
                acc[:, keep],
                started[:, keep],
                t[keep],
                kept[keep],
                kind[keep],
            )
            num_failures, num_preempts, tts = num_failures[keep], num_preempts[keep], tts[keep]
            pending_count, pending_sum = pending_count[keep], pending_sum[keep]
            ttr_sum, ttr_count = ttr_sum[keep], ttr_count[keep]

    out_acc[_PIECE_COLUMNS] += pieces_by_kind.T @ out_started  # the start-ups that ran whole
    out_acc += acc0[:, None]
    buckets = out_acc.T.copy()
    return BatchResult(
        buckets_s=buckets,
        wall_s=buckets.sum(axis=1),
        num_failures=out_failures,
        num_preemptions=out_preempts,
        tts_s=out_tts,
        ttr_sum_s=out_ttr_sum,
        ttr_count=out_ttr_count,
        kept_s=out_kept,
    )
