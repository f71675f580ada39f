"""`ettr demo`'s explanation: where the baseline and the optimized run differ, bucket by bucket, as text.

Pure: two reports in, lines out; every number is read from the reports.
"""

from __future__ import annotations

from ettr.accounting import EttReport
from ettr.accounting.model import distinct_saves
from ettr.events import Bucket
from ettr.report.svg import fmt_signed


def _recovery_s(report: EttReport, bucket: Bucket) -> float:
    return sum(a.buckets_s[bucket] for a in report.attempts[1:])


def explain(baseline: EttReport, optimized: EttReport, *, published: bool = True) -> str:
    """Where the two runs differ, bucket by bucket, read from their reports (`published`: the runs ended
    by publishing, inside the baseline job and standalone for the optimized one)."""
    gain = optimized.ett_pct - baseline.ett_pct
    lines = [
        f"optimized vs baseline: ETT {optimized.ett_pct:.1f}% vs {baseline.ett_pct:.1f}% ({fmt_signed(gain)} points), "
        f"wall {optimized.wall_s:.0f} s vs {baseline.wall_s:.0f} s"
    ]
    lost = [sum(a.lost_steps for a in r.attempts) for r in (baseline, optimized)]
    saves = [len(distinct_saves(r.checkpoint_commits)) for r in (baseline, optimized)]
    rows: list[tuple[str, float | None, float | None, str]] = [
        (
            "checkpoint_blocking",
            baseline.buckets_s[Bucket.CHECKPOINT_BLOCKING],
            optimized.buckets_s[Bucket.CHECKPOINT_BLOCKING],
            "async saves: the loop waits only for the copy",
        ),
        (
            "compile",
            baseline.buckets_s[Bucket.COMPILE],
            optimized.buckets_s[Bucket.COMPILE],
            "artifacts restored from ettr's compile store, warm from an earlier job",
        ),
        (
            "compile in recoveries",
            _recovery_s(baseline, Bucket.COMPILE),
            _recovery_s(optimized, Bucket.COMPILE),
            "artifacts restored from ettr's compile store",
        ),
        (
            "init",
            baseline.buckets_s[Bucket.INIT],
            optimized.buckets_s[Bucket.INIT],
            "start-up outside compile, restore and data",
        ),
        (
            "data_wait",
            baseline.buckets_s[Bucket.DATA_WAIT],
            optimized.buckets_s[Bucket.DATA_WAIT],
            "loader workers warm up while the model is built",
        ),
        (
            "wasted_progress",
            baseline.buckets_s[Bucket.WASTED_PROGRESS],
            optimized.buckets_s[Bucket.WASTED_PROGRESS],
            "the preemption saves before exiting",
        ),
        (
            "evaluation",
            baseline.buckets_s[Bucket.EVALUATION],
            optimized.buckets_s[Bucket.EVALUATION],
            "the job's own evaluation passes (no technique acts on them)",
        ),
        (
            "shutdown",
            baseline.buckets_s[Bucket.SHUTDOWN],
            optimized.buckets_s[Bucket.SHUTDOWN],
            "the artifact is built by a publish job of its own" if published else "final save and teardown",
        ),
        ("TTS", baseline.tts_s, optimized.tts_s, "time to the first step of attempt 0"),
        ("mean TTR", baseline.mean_ttr_s, optimized.mean_ttr_s, "failure detected -> training again"),
    ]
    for name, before, after, why in rows:
        if before is None or after is None or max(before, after) < 0.05:
            continue
        verdict = why if after < before or name == "evaluation" else "(not lower this time)"
        if name == "wasted_progress":  # the seconds hide how much work each side redid
            verdict += f"; steps redone {lost[0]} -> {lost[1]}"
        if name == "checkpoint_blocking":  # the auto interval may save more often, each save cheaper
            verdict += f"; saves {saves[0]} -> {saves[1]}"
            if after >= before and all(saves) and after / saves[1] < before / saves[0]:
                verdict = (
                    f"{why}: {before / saves[0]:.2f} -> {after / saves[1]:.2f} s a save; the auto interval "
                    f"saves {saves[1]} times instead of {saves[0]}"
                )
        lines.append(f"  {name:<22}{before:7.1f} s -> {after:6.1f} s   {verdict}")
    lines.extend(_training_lines(baseline, optimized))
    if gain <= 0:
        lines.append("  the optimized run's ETT% is not higher this time (a busy machine? run it again)")
    return "\n".join(lines)


def _training_lines(baseline: EttReport, optimized: EttReport) -> list[str]:
    """`effective_training` of the two sides, and why it differs for the same steps: the optimized side's
    steps run slower while a save persists beside them (counted as training, as ETT counts them)."""
    before = baseline.buckets_s[Bucket.EFFECTIVE_TRAINING]
    after = optimized.buckets_s[Bucket.EFFECTIVE_TRAINING]
    line = f"  {'effective_training':<22}{before:7.1f} s -> {after:6.1f} s   the same steps"
    slow = optimized.slowdown
    if slow is not None and slow.extra_s is not None and slow.inflation is not None:
        line += (
            f"; of the difference, {slow.extra_s:.1f} s are steps slowed {slow.inflation:.2f}x while "
            f"{len(slow.saves)} async saves persisted beside them (in ETT: they still train)"
        )
        rest = after - before - slow.extra_s
        if rest >= 0.5:
            line += f"; the other {rest:.1f} s: steps slower outside the persists (not attributed)"
    return [line]
