"""`ettr demo`'s story in numbers: what each technique bought, the start-up and recoveries piece by piece,
the init audit before and after, and both sides projected to a fleet-scale job through `ettr.simulate`.

Everything is read from the two run directories' reports and events (`build_story`); nothing is assumed
about either side. Its text lines and pictures are `ettr.demo.render` (`story_lines`, `story_sections`).

    story = build_story(baseline_dir, optimized_dir)
    story.techniques      # per technique: the buckets it acts on, seconds on each side, share of the gain
    story.tts_steps       # baseline TTS -> each technique's change -> optimized TTS (attempt 0's buckets)
    story.recoveries      # per failure: each side's TTR by bucket
    story.audits          # per side and attempt: start-up collectives and process groups (rank 0)
    story.replays         # per side: the simulator's replay of the run's own failures vs the measured ETT
    story.projection      # both sides at FLEET scale, from their measured profiles
    story.equal_speed     # the gain at equal step speed: how much of the raw gain came from slower steps
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ettr.accounting import EttReport
from ettr.demo.cpu_meter import CpuSample, CpuShare, share_between
from ettr.events import Bucket, Event, EventKind

REPLAY_TOLERANCE_POINTS = 2.0
"""The simulator's replay of a run must predict its measured ETT% within this many points."""


@dataclass(frozen=True, kw_only=True)
class Technique:
    """One of the optimized side's techniques, and the buckets where its effect shows."""

    name: str
    mechanism: str
    buckets: tuple[Bucket, ...]


TECHNIQUES = (
    Technique(
        name="compile store (warm)",
        mechanism="artifacts of an earlier job of the same model restored, not compiled",
        buckets=(Bucket.COMPILE,),
    ),
    Technique(
        name="overlapped start-up",
        mechanism="loader workers warm up while the model is built",
        buckets=(Bucket.DATA_WAIT,),
    ),
    Technique(
        name="start-up not repeated",
        mechanism=(
            "sharding plan computed once and read back; the crash recovered in place (the other rank keeps "
            "its process), its replacement a spare forked from the agent's zygote that ran the script's start-up "
            "(loader workers) ahead"
        ),
        buckets=(Bucket.INIT,),
    ),
    Technique(
        name="async checkpoints",
        mechanism="the loop waits for the copy only; persist in the background",
        buckets=(Bucket.CHECKPOINT_BLOCKING, Bucket.RESTORE),
    ),
    Technique(
        name="save-then-exit + auto interval",
        mechanism="the preemption saves first; the interval follows the measured failure rate",
        buckets=(Bucket.WASTED_PROGRESS,),
    ),
    Technique(
        name="standalone publishing + fast exit",
        mechanism="the artifact is built by a job of its own; no teardown after the final commit",
        buckets=(Bucket.SHUTDOWN,),
    ),
    Technique(
        name="evaluation (no technique)",
        mechanism="the job's own evaluation passes: the same work on both sides",
        buckets=(Bucket.EVALUATION,),
    ),
    Technique(
        name="relaunch",
        mechanism=(
            "failure -> next attempt: torchrun relaunched cold vs ettr's agent going on in place, the crashed "
            "rank's parked spare promoted"
        ),
        buckets=(Bucket.RESTART, Bucket.OTHER, Bucket.SCHEDULING, Bucket.HARDWARE_SETUP),
    ),
)
"""Every bucket but `effective_training` belongs to exactly one technique (checked by the tests)."""


@dataclass(frozen=True, kw_only=True)
class TechniqueGain:
    technique: Technique
    baseline_s: float
    optimized_s: float
    share_pct: float | None
    """Share of the wall time the optimized side saved (None when it saved none)."""
    points: float | None
    """ETT points of the gain in proportion to that share."""

    @property
    def saved_s(self) -> float:
        return self.baseline_s - self.optimized_s


@dataclass(frozen=True, kw_only=True)
class Step:
    """One bar of the technique waterfall: `label`, change in seconds (a total when `total`)."""

    label: str
    seconds: float
    total: bool = False


@dataclass(frozen=True, kw_only=True)
class RecoveryPair:
    """The n-th failure of both sides: its kind and each side's TTR by bucket."""

    index: int
    outcome: str
    baseline: Mapping[Bucket, float]
    optimized: Mapping[Bucket, float]


@dataclass(frozen=True, kw_only=True)
class Audit:
    """Start-up collectives of one attempt of one side (rank 0's `init_comm_audit` mark)."""

    side: str
    attempt: int
    num_calls: int
    num_groups: int
    total_s: float
    ops: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class Replay:
    side: str
    measured_ett_pct: float
    predicted_ett_pct: float
    speed_note: str | None = None
    """Where the run's lost steps ran at another speed than its mean (`Profile.speed_note`): what the
    replay, at one speed, cannot reproduce."""

    @property
    def ok(self) -> bool:
        return abs(self.predicted_ett_pct - self.measured_ett_pct) <= REPLAY_TOLERANCE_POINTS


@dataclass(frozen=True, kw_only=True)
class FleetScale:
    """The job a fleet runs: the size, length and failure rate both sides are projected to."""

    gpus: int = 1024
    gpus_per_node: int = 8
    days: float = 14.0
    failures_per_node_day: float = 24.0 / 7.9 / 128
    """Meta's research clusters: a 1,024-GPU job fails every 7.9 hours on average (Kokolis et al.,
    "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", 2024): ~0.024 per node-day."""
    source: str = "MTTF 7.9 h at 1,024 GPUs (Kokolis et al. 2024, Meta's RSC clusters)"
    runs: int = 20
    seed: int = 0


FLEET = FleetScale()


@dataclass(frozen=True, kw_only=True)
class Projected:
    side: str
    ett_pct: float
    ett_pct_ci95: tuple[float, float]
    interval_s: float
    num_failures_mean: float
    mean_ttr_s: float | None


@dataclass(frozen=True, kw_only=True)
class EqualSpeed:
    """The optimized side at the baseline's pace: its kept steps timed at the baseline's effective training
    per kept step, every other second as measured (`equal_speed`)."""

    baseline_step_s: float
    """The baseline's effective training per kept step (its mean pace; what ETT counts per step)."""
    optimized_step_s: float
    baseline_median_step_s: float | None
    optimized_median_step_s: float | None
    num_kept_steps: int
    """The optimized side's kept steps."""
    effective_s: float
    """Its effective training as measured."""
    effective_at_baseline_s: float
    """Its kept steps at the baseline's pace."""
    wall_s: float
    wall_at_baseline_s: float
    """Its wall time with its kept steps at the baseline's pace: the wall time of the same work."""
    baseline_wall_s: float
    baseline_ett_pct: float
    ett_pct: float
    ett_at_baseline_pct: float
    """The ETT the optimized side would have at the baseline's step time."""
    side_by_side: bool = False
    """The two sides ran at the same time, each on CPUs of its own (else one after the other)."""
    together: StepsTogether | None = None
    """Side by side: both sides' steps over the wall time both were training (None: one after the other,
    or no such time)."""

    @property
    def raw_gain_points(self) -> float:
        return self.ett_pct - self.baseline_ett_pct

    @property
    def gain_points(self) -> float:
        """The gain at equal step speed."""
        return self.ett_at_baseline_pct - self.baseline_ett_pct

    @property
    def from_speed_points(self) -> float:
        """The part of the raw gain that came from the step-speed difference (positive: slower steps)."""
        return self.raw_gain_points - self.gain_points

    @property
    def median_step_change_pct(self) -> float | None:
        """How much longer the optimized side's median step is than the baseline's, in % (None: a side has
        no median)."""
        b, o = self.baseline_median_step_s, self.optimized_median_step_s
        if b is None or o is None or not b > 0:
            return None
        return (o / b - 1.0) * 100.0


@dataclass(frozen=True, kw_only=True)
class StepsTogether:
    """Both sides' median step over the stretch of wall time in which both were training, side by side
    (`steps_together`). A side that finishes first leaves its CPUs to the machine's other load, which then
    leaves the other side's: the steps that side runs alone afterwards are faster, and its median over the
    whole job holds them. Over this stretch the same load was beside both."""

    begin_ts: float
    end_ts: float
    baseline_median_step_s: float
    optimized_median_step_s: float
    num_baseline_steps: int
    num_optimized_steps: int
    beside: tuple[CpuShare, CpuShare] | None = None
    """What the baseline's and the optimized side's CPUs gave to other processes over the stretch
    (`ettr.demo.cpu_meter`); None where the demo did not sample them."""

    @property
    def change_pct(self) -> float:
        """How much longer the optimized side's median step is than the baseline's over the stretch, in %."""
        return (self.optimized_median_step_s / self.baseline_median_step_s - 1.0) * 100.0


def steps_together(
    baseline: Sequence[tuple[float, float]], optimized: Sequence[tuple[float, float]]
) -> StepsTogether | None:
    """The two sides' timed steps ((end, seconds) in time order, `ettr.accounting.compute.timed_steps`: every
    step, kept or redone, whose interval no blocking phase overlaps) that ended while both sides were
    training: from the later of the two first steps to the earlier of the two last. None when the two
    stretches of training do not overlap."""
    if not baseline or not optimized:
        return None
    begin = max(baseline[0][0], optimized[0][0])
    end = min(baseline[-1][0], optimized[-1][0])
    b = [seconds for ts, seconds in baseline if begin <= ts <= end]
    o = [seconds for ts, seconds in optimized if begin <= ts <= end]
    b_median, o_median = (statistics.median(x) if x else 0.0 for x in (b, o))
    if not b_median > 0 or not o_median > 0:
        return None
    return StepsTogether(
        begin_ts=begin,
        end_ts=end,
        baseline_median_step_s=b_median,
        optimized_median_step_s=o_median,
        num_baseline_steps=len(b),
        num_optimized_steps=len(o),
    )


STEP_SPEED_BOUND_PCT = 5.0
"""The optimized side's median step time is held to within this many % of the baseline's (issue 26.2):
ettr's own work (async persists, standbys, restores) must not slow the training steps beside it."""


@dataclass(frozen=True, kw_only=True)
class Story:
    techniques: tuple[TechniqueGain, ...]
    tts_steps: tuple[Step, ...]
    recoveries: tuple[RecoveryPair, ...]
    audits: tuple[Audit, ...]
    replays: tuple[Replay, ...]
    projection: tuple[Projected, ...]
    fleet: FleetScale
    notes: tuple[str, ...]
    """What could not be computed, and why."""
    equal_speed: EqualSpeed | None = None
    """The gain at equal step speed; None when a side kept no step."""


# -- pure parts -------------------------------------------------------------------------------------------
def technique_gains(baseline: EttReport, optimized: EttReport) -> tuple[TechniqueGain, ...]:
    """Per technique: its buckets' seconds on each side, and its share of the wall time saved (of the
    techniques that saved time; those that cost time show a negative saving and no share)."""
    rows = [
        (
            t,
            sum(baseline.buckets_s[b] for b in t.buckets),
            sum(optimized.buckets_s[b] for b in t.buckets),
        )
        for t in TECHNIQUES
    ]
    saved_total = sum(b - o for _, b, o in rows)
    gain = optimized.ett_pct - baseline.ett_pct
    out = []
    for t, b, o in rows:
        share = (b - o) / saved_total * 100 if saved_total > 0 else None
        out.append(
            TechniqueGain(
                technique=t,
                baseline_s=b,
                optimized_s=o,
                share_pct=share,
                points=gain * share / 100 if share is not None else None,
            )
        )
    return tuple(out)


def equal_speed(baseline: EttReport, optimized: EttReport) -> EqualSpeed | None:
    """The optimized side as if its kept steps ran at the baseline's pace (None when a side kept no step).

    ETT% is a share of time: slower steps raise it for the same work. The pace of a side is its effective
    training per kept step (the mean, which is exactly what its ETT counts; the medians are kept beside it).
    Every other second of the optimized side (start-up, saves, recoveries, steps that were redone) stays as
    measured, so the wall time at the baseline's pace is the wall time of the same work at equal step speed."""
    if baseline.num_kept_steps <= 0 or optimized.num_kept_steps <= 0:
        return None
    base_step = baseline.effective_training_s / baseline.num_kept_steps
    effective_at_base = optimized.num_kept_steps * base_step
    wall_at_base = optimized.wall_s - optimized.effective_training_s + effective_at_base
    if not wall_at_base > 0:
        return None
    return EqualSpeed(
        baseline_step_s=base_step,
        optimized_step_s=optimized.effective_training_s / optimized.num_kept_steps,
        baseline_median_step_s=baseline.step_time_s,
        optimized_median_step_s=optimized.step_time_s,
        num_kept_steps=optimized.num_kept_steps,
        effective_s=optimized.effective_training_s,
        effective_at_baseline_s=effective_at_base,
        wall_s=optimized.wall_s,
        wall_at_baseline_s=wall_at_base,
        baseline_wall_s=baseline.wall_s,
        baseline_ett_pct=baseline.ett_pct,
        ett_pct=optimized.ett_pct,
        ett_at_baseline_pct=effective_at_base / wall_at_base * 100.0,
    )


def tts_buckets(report: EttReport) -> dict[Bucket, float]:
    """Seconds of each bucket inside the TTS window (allocation, else supervisor start, to attempt 0's
    first step), as the report's timeline has them."""
    out = {b: 0.0 for b in Bucket}
    if report.tts_window is None:
        return out
    start, end = report.tts_window.origin_ts, report.tts_window.training_start_ts
    for seg in report.segments:
        b, e = max(seg.start_ts, start), min(seg.end_ts, end)
        if e > b:
            out[seg.bucket] += e - b
    return out


def tts_steps(baseline: EttReport, optimized: EttReport) -> tuple[Step, ...]:
    """Baseline TTS, then each technique's change of its buckets inside the TTS window, then the
    optimized TTS (the changes add up to the difference)."""
    if baseline.tts_s is None or optimized.tts_s is None:
        return ()
    before, after = tts_buckets(baseline), tts_buckets(optimized)
    steps = [Step(label="baseline TTS", seconds=baseline.tts_s, total=True)]
    for t in TECHNIQUES:
        delta = sum(after[b] - before[b] for b in t.buckets)
        if abs(delta) >= 0.05:
            steps.append(Step(label=t.name, seconds=delta))
    steps.append(Step(label="optimized TTS", seconds=optimized.tts_s, total=True))
    return tuple(steps)


def recovery_buckets(report: EttReport) -> list[tuple[str, dict[Bucket, float]]]:
    """Each recovery's (failed attempt's outcome, seconds by bucket from detection to training again)."""
    out = []
    for r in report.recoveries:
        spent = {b: 0.0 for b in Bucket}
        for seg in report.segments:
            b, e = max(seg.start_ts, r.detected_ts), min(seg.end_ts, r.training_start_ts)
            if e > b:
                spent[seg.bucket] += e - b
        out.append((str(r.failed.outcome), spent))
    return out


def recovery_pairs(baseline: EttReport, optimized: EttReport) -> tuple[RecoveryPair, ...]:
    pairs = zip(recovery_buckets(baseline), recovery_buckets(optimized), strict=False)
    return tuple(
        RecoveryPair(index=i + 1, outcome=b[0], baseline=b[1], optimized=o[1])
        for i, (b, o) in enumerate(pairs)
    )


def audits(side: str, events: Sequence[Event]) -> list[Audit]:
    """Rank 0's start-up audit of every attempt of one side (`ettr.audit`'s mark)."""
    from ettr.audit import MARK_NAME

    out = []
    for e in events:
        data = e.data or {}
        if e.kind is not EventKind.MARK or e.rank != 0 or data.get("name") != MARK_NAME:
            continue
        ops: dict[str, int] = {}
        for stage in (data.get("stages") or {}).values():
            for op, stats in stage.items():
                ops[op] = ops.get(op, 0) + int(stats.get("num_calls", 0))
        out.append(
            Audit(
                side=side,
                attempt=e.attempt,
                num_calls=int(data.get("num_calls", 0)),
                num_groups=int(data.get("num_groups_created", 0)),
                total_s=float(data.get("total_s", 0.0)),
                ops=ops,
            )
        )
    return sorted(out, key=lambda a: a.attempt)


# -- through the simulator --------------------------------------------------------------------------------
def _replay_and_project(
    names: Sequence[str], run_dirs: Sequence[str | os.PathLike[str]], fleet: FleetScale
) -> tuple[list[Replay], list[Projected], list[str]]:
    from ettr.simulate.analytic import optimal_interval_for
    from ettr.simulate.profile import load_profile
    from ettr.simulate.summary import replay, simulate

    replays, projected, notes = [], [], []
    for name, run_dir in zip(names, run_dirs, strict=True):
        try:
            profile = load_profile(run_dir)
        except Exception as exc:  # a run that never trained has no profile: say so, never a number
            notes.append(f"{name}: no profile ({exc}); no replay and no projection")
            continue
        predicted = replay(profile.params, profile.script)
        replays.append(
            Replay(
                side=name,
                measured_ett_pct=profile.measured_ett_pct,
                predicted_ett_pct=predicted.ett_pct,
                speed_note=profile.speed_note(),
            )
        )
        params = replace(
            profile.params,
            gpus=fleet.gpus,
            gpus_per_node=fleet.gpus_per_node,
            failures_per_node_day=fleet.failures_per_node_day,
            preemptions_per_day=0.0,
            duration_s=fleet.days * 86_400.0,
            work_s=None,
        )
        if name == "optimized":  # its interval is `auto`: the optimum at the fleet's failure rate
            params = replace(params, interval_s=optimal_interval_for(params))
        summary = simulate(params, runs=fleet.runs, seed=fleet.seed)
        projected.append(
            Projected(
                side=name,
                ett_pct=summary.ett_pct,
                ett_pct_ci95=summary.ett_pct_ci95,
                interval_s=summary.interval_s,
                num_failures_mean=summary.num_failures_mean,
                mean_ttr_s=summary.mean_ttr_s,
            )
        )
    return replays, projected, notes


def build_story(
    baseline_dir: str | os.PathLike[str],
    optimized_dir: str | os.PathLike[str],
    *,
    fleet: FleetScale = FLEET,
    side_by_side: bool = False,
    cpu_samples: tuple[Sequence[CpuSample], Sequence[CpuSample]] | None = None,
    cpus_per_side: int = 1,
) -> Story:
    """The whole story of a demo from its two run directories (raises UsageError for an unreadable one).
    `side_by_side`: the two jobs ran at the same time, each on CPUs of its own (`cpus_per_side` each);
    `cpu_samples`: each side's looks at its CPUs meanwhile (`ettr.demo.cpu_meter`)."""
    from ettr.accounting.compute import timed_steps
    from ettr.report.load import read_run

    (b_events, baseline), (o_events, optimized) = read_run(baseline_dir), read_run(optimized_dir)
    together = None
    if side_by_side:
        b_steps, o_steps = (
            timed_steps(ev, max((e.ts for e in ev), default=0.0)) for ev in (b_events, o_events)
        )
        together = steps_together(b_steps, o_steps)
    if together is not None and cpu_samples is not None:
        b_share, o_share = (
            share_between(samples, together.begin_ts, together.end_ts, num_cpus=cpus_per_side)
            for samples in cpu_samples
        )
        if b_share is not None and o_share is not None:
            together = replace(together, beside=(b_share, o_share))
    replays, projection, notes = _replay_and_project(
        ("baseline", "optimized"), (baseline_dir, optimized_dir), fleet
    )
    return Story(
        techniques=technique_gains(baseline, optimized),
        tts_steps=tts_steps(baseline, optimized),
        recoveries=recovery_pairs(baseline, optimized),
        audits=tuple(audits("baseline", b_events) + audits("optimized", o_events)),
        replays=tuple(replays),
        projection=tuple(projection),
        fleet=fleet,
        notes=tuple(notes),
        equal_speed=_ran(equal_speed(baseline, optimized), side_by_side=side_by_side, together=together),
    )


def _ran(e: EqualSpeed | None, *, side_by_side: bool, together: StepsTogether | None) -> EqualSpeed | None:
    return None if e is None else replace(e, side_by_side=side_by_side, together=together)
