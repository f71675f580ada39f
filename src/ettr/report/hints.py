"""What to do next when a report has nothing to show: a job that recorded no training step says why it might
not have (one line each), instead of a silent "ETT 0.0% | idle 100.0%"; a restore of a torn checkpoint; a
restart that started over although a checkpoint had committed."""

from __future__ import annotations

from collections.abc import Sequence

from ettr.accounting import EttReport, unrecorded_pids
from ettr.accounting.ttr import NOTHING_RESTORED
from ettr.events import Event, EventKind, Phase


def no_step_hints(events: Sequence[Event], report: EttReport) -> list[str]:
    """Lines for a job none of whose attempts recorded a training step (empty when one did)."""
    if any(a.last_step is not None for a in report.attempts) or any(e.kind is EventKind.STEP for e in events):
        return []
    start = next((e for e in events if e.kind is EventKind.SUPERVISOR_START and e.data), None)
    data = start.data if start is not None and start.data else {}
    if data.get("auto") is False:
        return [
            "no training step was recorded: with --no-auto ettr sees only what the script says; call "
            "ettr.step(n) after each optimizer step (docs/supervisor.md), or run without --no-auto"
        ]
    if not any(e.rank >= 0 for e in events):
        if data.get("launcher") == "other":
            return [
                "no training step was recorded, and no process of the job reported anything: ettr instruments "
                "the python and torchrun processes the command starts (behind a shell wrapper too, as long as "
                "they get its environment: env -i, sudo, ssh or a container cut them off); did it start one, "
                "and with ETTR_* and PYTHONPATH passed on?"
            ]
        return [
            "no training step was recorded, and no process of the job reported anything (a script run "
            "outside `ettr run` records only after ettr.init(RUN_DIR))"
        ]
    if unrecorded_pids(events) and report.ett_unknown:  # Hogwild-style: steps in processes that are no ranks
        return [f"{report.ett_unknown}; ETT is unknown, and the start-up above holds their training"]
    if report.attempts and all(a.failure for a in report.attempts):
        return []  # every attempt failed before training: the failures say why
    return [
        "no training step was recorded: ettr counts a step at each torch.optim optimizer step (or a "
        "DistributedOptimizer step, ettr.step(n), or a Lightning/HF callback); a job that never stepped an "
        "optimizer shows all its time as start-up"
    ]


def torn_checkpoint_hints(events: Sequence[Event]) -> list[str]:
    """A line for each checkpoint that attempts restored although its last save, in an earlier attempt, began
    but never committed: the process ended mid-save (killed, preempted past its grace), so the files there may
    be partial. Frameworks that resume from "the newest checkpoint directory" (Hugging Face's
    `get_last_checkpoint`, a glob for the highest step) pick such a torn one; the restore then fails the same
    way each attempt (`ettr run` stops: restarts would not help), or resumes from half a state.

    Paths come from the RESTORE phase's `path` (the Lightning and Hugging Face callbacks) and the
    CHECKPOINT_BLOCKING phase's `path`; a save counts as committed by its CHECKPOINT_COMMIT or its
    `checkpoint_file` mark (a second file of one checkpoint). Saves and commits are matched by count within
    an attempt (a save is torn when a rank began more saves of the path than were committed), not by order:
    every rank of a DDP job times its part of a save, rank 0 alone commits, and a slower rank's save can
    begin after that commit. The saves that count are those of the committing ranks (the lowest saving rank
    when no commit was recorded at all) and, for a path a committing rank restored later, every rank's: a
    committing rank killed mid-save may not have written its own begin yet (the writer thread flushes within
    half a second), while the other ranks' begins of the same checkpoint reached the ledger."""
    ordered = sorted(events, key=lambda e: e.ts)

    def path_of(e: Event) -> str | None:
        path = e.data.get("path") if e.data else None
        return path if isinstance(path, str) and path else None

    saves = [
        e
        for e in ordered
        if e.kind is EventKind.PHASE_BEGIN and e.phase is Phase.CHECKPOINT_BLOCKING and path_of(e)
    ]
    committers = {e.rank for e in ordered if e.kind is EventKind.CHECKPOINT_COMMIT}
    committers = committers or {min((e.rank for e in saves), default=0)}
    restores = [
        e
        for e in ordered
        if e.kind in (EventKind.PHASE_BEGIN, EventKind.PHASE_END)  # a span too
        and e.phase is Phase.RESTORE
        and path_of(e)
    ]
    shared = {path_of(e) for e in restores if e.rank in committers}
    # (attempt, path) -> rank -> that rank's save begins, in order; the commits of each rank
    begun: dict[tuple[int, str], dict[int, list[Event]]] = {}
    for e in saves:
        path = path_of(e)
        if path is not None and (e.rank in committers or path in shared):
            begun.setdefault((e.attempt, path), {}).setdefault(e.rank, []).append(e)
    done: dict[tuple[int, str], dict[int, int]] = {}
    commits = []
    for e in ordered:
        path = path_of(e)
        if path is not None and (
            e.kind is EventKind.CHECKPOINT_COMMIT
            or (e.kind is EventKind.MARK and e.data is not None and e.data.get("name") == "checkpoint_file")
        ):
            per_rank = done.setdefault((e.attempt, path), {})
            per_rank[e.rank] = per_rank.get(e.rank, 0) + 1
            if e.kind is EventKind.CHECKPOINT_COMMIT:
                commits.append(e)

    def torn_save(attempt: int, path: str) -> Event | None:
        """The last save of `path` in `attempt` if it never committed."""
        per_rank = begun.get((attempt, path), {})
        most = max((len(v) for v in per_rank.values()), default=0)
        if most <= max(done.get((attempt, path), {}).values(), default=0):
            return None
        ranks = sorted(per_rank, key=lambda r: (r not in committers, -len(per_rank[r]), r))
        return per_rank[ranks[0]][-1]

    # (path, the save's attempt) -> the torn save, the attempts that restored it
    torn: dict[tuple[str, int], tuple[Event, list[int]]] = {}
    for e in restores:
        path = path_of(e)
        earlier = [a for (a, p) in begun if p == path and a < e.attempt]
        if path is None or not earlier:
            continue  # never saved by this job before this attempt (a save of this attempt: in progress)
        save = torn_save(max(earlier), path)
        if save is None:
            continue  # its last save committed
        _, attempts = torn.setdefault((path, save.attempt), (save, []))
        if e.attempt not in attempts:
            attempts.append(e.attempt)
    lines = []
    for (path, _), (save, attempts) in torn.items():
        commit = next((c for c in reversed(commits) if c.ts < save.ts), None)
        who = f"attempt {attempts[0]}" if len(attempts) == 1 else f"attempts {', '.join(map(str, attempts))}"
        at = f" at step {save.step}" if save.step is not None else ""
        last = (
            f"; the last committed checkpoint before it: {commit.data.get('path')} (step {commit.step})"
            if commit is not None and commit.data
            else "; no checkpoint had committed before it"
        )
        lines.append(
            f"{who} restored {path}, whose save{at} in attempt {save.attempt} never completed (the process ended "
            f"mid-save): its files may be partial{last}. If the restore fails the same way each attempt, move "
            "the torn checkpoint aside and requeue"
        )
    return lines


def started_over_hints(events: Sequence[Event], report: EttReport) -> list[str]:
    """A line for each recovered attempt that started over (restored nothing: `NOTHING_RESTORED`) although an
    earlier attempt had committed a checkpoint of a later step than 0: the script resumes from none of its
    own checkpoints, and each restart costs every step before it. Field trial: Lightning's bug_report_model
    under `sbatch` without `--ntasks`: Lightning does not take the job for a Slurm one (no `SLURM_NTASKS`),
    so its auto-requeue saved no `hpc_ckpt_N.ckpt`; its ModelCheckpoint had committed step 2661, and the
    requeued run started over from step 0."""
    commits = [e for e in events if e.kind is EventKind.CHECKPOINT_COMMIT and e.step]
    lines = []
    for parts in report.ttr_parts:
        earlier = [c for c in commits if c.attempt < parts.recovered_attempt]
        if parts.restored_from != NOTHING_RESTORED or not earlier:
            continue
        last = max(earlier, key=lambda c: (c.step or 0, c.ts))
        path = last.data.get("path") if last.data else None
        where = f" ({path})" if isinstance(path, str) and path else ""
        lines.append(
            f"attempt {parts.recovered_attempt} started over from step 0 although attempt {last.attempt} had "
            f"committed a checkpoint of step {last.step}{where}: the script resumed from none of its checkpoints. "
            "Make it resume from its latest one (Lightning: `fit(ckpt_path=...)`; Lightning's Slurm "
            "auto-requeue saves and restores `hpc_ckpt_N.ckpt` only where Lightning sees a Slurm job: "
            "`SLURM_NTASKS` set: `#SBATCH --ntasks=1` or srun; and where its SIGUSR1 handler completes, docs/slurm.md)"
        )
    return lines
