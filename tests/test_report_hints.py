"""The report's notes from the events alone (`ettr.report.hints`): a restore of a checkpoint whose save began
in an earlier attempt and never committed (the process ended mid-save, so its files may be partial)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ettr.events import Event, EventKind, Phase
from ettr.report.hints import torn_checkpoint_hints

OUT = "/job/out"


def _save(ts: float, attempt: int, step: int, *, committed: bool) -> list[Event]:
    path = f"{OUT}/checkpoint-{step}"
    events = [
        Event(EventKind.PHASE_BEGIN, ts, attempt, 0, Phase.CHECKPOINT_BLOCKING, step, data={"path": path})
    ]
    if committed:
        events += [
            Event(
                EventKind.PHASE_END, ts + 1, attempt, 0, Phase.CHECKPOINT_BLOCKING, step, data={"path": path}
            ),
            Event(EventKind.CHECKPOINT_COMMIT, ts + 1, attempt, 0, step=step, data={"path": path}),
        ]
    return events


def _restore(ts: float, attempt: int, path: str) -> Event:
    return Event(
        EventKind.PHASE_BEGIN, ts, attempt, 0, Phase.RESTORE, data={"stage": "from_checkpoint", "path": path}
    )


def test_a_restore_of_a_save_cut_off_in_an_earlier_attempt_is_named_with_the_last_committed_one() -> None:
    # Hugging Face's get_last_checkpoint picks checkpoint-40, whose save was killed after the weights.
    events = [
        *_save(10, 0, 20, committed=True),
        *_save(20, 0, 40, committed=False),
        _restore(30, 1, f"{OUT}/checkpoint-40"),
        _restore(40, 2, f"{OUT}/checkpoint-40"),
        _restore(41, 2, f"{OUT}/checkpoint-40"),  # optimizer, RNG of the same attempt
    ]
    [hint] = torn_checkpoint_hints(events)  # one note a checkpoint, naming the attempts that read it
    assert hint.startswith(
        f"attempts 1, 2 restored {OUT}/checkpoint-40, whose save at step 40 in attempt 0 never"
    )
    assert f"last committed checkpoint before it: {OUT}/checkpoint-20 (step 20)" in hint
    [hint] = torn_checkpoint_hints(events[3:5])  # the torn save and one restore, nothing committed before
    assert hint.startswith(f"attempt 1 restored {OUT}/checkpoint-40")
    assert "no checkpoint had committed before it" in hint


def test_committed_checkpoints_and_second_files_of_one_are_not_torn() -> None:
    last = "/job/ckpt/last.ckpt"
    events = [
        *_save(10, 0, 20, committed=True),
        # Lightning's save_last: a second file of the same checkpoint, marked when written.
        Event(EventKind.PHASE_BEGIN, 11, 0, 0, Phase.CHECKPOINT_BLOCKING, 20, data={"path": last}),
        Event(EventKind.MARK, 12, 0, 0, data={"name": "checkpoint_file", "step": 20, "path": last}),
        _restore(30, 1, f"{OUT}/checkpoint-20"),
        _restore(30, 1, last),
        _restore(30, 1, "/elsewhere/pretrained"),  # never saved by this job: nothing to say
    ]
    assert torn_checkpoint_hints(events) == []


def test_a_save_rewritten_and_committed_later_is_no_longer_torn() -> None:
    events = [
        *_save(10, 0, 40, committed=False),
        *_save(20, 1, 40, committed=True),
        _restore(30, 2, f"{OUT}/checkpoint-40"),
    ]
    assert torn_checkpoint_hints(events) == []


def test_a_slower_rank_timing_its_part_after_rank_0_committed_is_not_a_torn_save() -> None:
    path = f"{OUT}/checkpoint-20"
    events = [
        *_save(10, 0, 20, committed=True),  # rank 0: begin at 10, commit at 11
        Event(EventKind.PHASE_BEGIN, 12, 0, 1, Phase.CHECKPOINT_BLOCKING, 20, data={"path": path}),  # rank 1
        _restore(30, 1, path),
    ]
    assert torn_checkpoint_hints(events) == []
    # No commit recorded at all (killed in the first save): the lowest saving rank's saves count.
    events = [events[0], events[3], _restore(30, 1, path)]
    assert torn_checkpoint_hints(events)[0].startswith(f"attempt 1 restored {path}")


def test_ettr_report_prints_the_note_after_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ettr.cli import main
    from ettr.ledger.sqlite import SqliteLedger

    torn = f"{OUT}/checkpoint-40"
    ledger = SqliteLedger(tmp_path / "ledger.db")
    ledger.append(
        [
            Event(EventKind.ATTEMPT_START, 1.0, 0, -1),
            Event(EventKind.STEP, 2.0, 0, 0, step=40),
            *_save(3.0, 0, 40, committed=False),
            Event(EventKind.ATTEMPT_END, 4.0, 0, -1, data={"outcome": "failed", "exit_code": 137}),
            Event(EventKind.ATTEMPT_START, 5.0, 1, -1),
            _restore(6.0, 1, torn),
            Event(EventKind.ATTEMPT_END, 7.0, 1, -1, data={"outcome": "failed", "exit_code": 1}),
        ]
    )
    ledger.close()
    assert main(["report", str(tmp_path)]) == 0
    assert f"\nnote: attempt 1 restored {torn}, whose save at step 40 in attempt 0 never completed" in (
        capsys.readouterr().out
    )


def test_rank_0_killed_before_its_save_begin_was_written_is_found_by_the_other_ranks_begins() -> None:
    # kill -9 of rank 0 inside a Hugging Face save: its queued CHECKPOINT_BLOCKING begin never reached the
    # ledger; rank 1 timed its part of the same checkpoint; get_last_checkpoint then picks the torn one.
    def part(ts: float, attempt: int, rank: int, step: int) -> Event:
        path = f"{OUT}/checkpoint-{step}"
        return Event(
            EventKind.PHASE_BEGIN, ts, attempt, rank, Phase.CHECKPOINT_BLOCKING, step, data={"path": path}
        )

    torn = f"{OUT}/checkpoint-30"
    events = [
        *_save(10, 0, 20, committed=True),
        part(12, 0, 1, 20),  # rank 1's part of checkpoint-20, after rank 0's commit
        part(20, 0, 1, 30),  # rank 1's part of checkpoint-30; rank 0's begin was lost
        _restore(30, 1, torn),
        Event(EventKind.PHASE_BEGIN, 30, 1, 1, Phase.RESTORE, data={"path": torn}),
    ]
    [hint] = torn_checkpoint_hints(events)
    assert hint.startswith(f"attempt 1 restored {torn}, whose save at step 30 in attempt 0 never completed")
    assert f"last committed checkpoint before it: {OUT}/checkpoint-20 (step 20)" in hint
    # A rank's own file that rank 0 never restores is not rank 0's checkpoint: its saves do not count.
    own = "/job/out/rng_state_1.pth"
    events = [
        *_save(10, 0, 20, committed=True),
        Event(EventKind.PHASE_BEGIN, 11, 0, 1, Phase.CHECKPOINT_BLOCKING, 20, data={"path": own}),
        Event(EventKind.PHASE_BEGIN, 30, 1, 1, Phase.RESTORE, data={"path": own}),
    ]
    assert torn_checkpoint_hints(events) == []


def _requeued_job(resumed_from: int | None) -> list[Event]:
    """Attempt 0 commits step 10's checkpoint and is preempted at step 12; the requeued attempt 1 resumes from
    `resumed_from` (None: it started over) and completes step 20."""
    from ettr.events import SUPERVISOR_RANK

    def sup(kind: EventKind, ts: float, attempt: int, **data: object) -> Event:
        return Event(kind, ts, attempt, SUPERVISOR_RANK, data=data or None)

    path = f"{OUT}/epoch=9-step=10.ckpt"
    events = [sup(EventKind.SUPERVISOR_START, 0, 0), sup(EventKind.ATTEMPT_START, 1, 0, pid=1000)]
    events += [Event(EventKind.STEP, 2 + n, 0, 0, step=n) for n in range(1, 13)]
    events.append(Event(EventKind.CHECKPOINT_COMMIT, 12.5, 0, 0, step=10, data={"path": path}))
    events.append(sup(EventKind.ATTEMPT_END, 15, 0, outcome="preempted", exit_code=0))
    events += [sup(EventKind.SUPERVISOR_START, 20, 1), sup(EventKind.ATTEMPT_START, 21, 1, pid=1001)]
    events.append(Event(EventKind.RESUMED, 22, 1, 0, step=resumed_from))
    first = (resumed_from or 0) + 1
    events += [Event(EventKind.STEP, 23 + i, 1, 0, step=n) for i, n in enumerate(range(first, 21))]
    events += [sup(EventKind.ATTEMPT_END, 50, 1, outcome="completed", exit_code=0)]
    return [*events, sup(EventKind.JOB_END, 51, 1, exit_status=0)]


def test_a_requeued_attempt_that_started_over_past_a_committed_checkpoint_is_named() -> None:
    # Field trial: Lightning's bug_report_model under sbatch without --ntasks. Lightning did not take the job
    # for a Slurm one, its auto-requeue saved no hpc checkpoint, and the requeued run started over from step
    # 0 past its ModelCheckpoint's step 2661: the report said only "(restored from) nothing".
    from ettr.accounting import compute
    from ettr.report.hints import started_over_hints

    events = _requeued_job(None)
    [hint] = started_over_hints(events, compute(events, 52.0, supervisor_alive=False))
    assert hint.startswith("attempt 1 started over from step 0 although attempt 0 had committed a checkpoint")
    assert f"of step 10 ({OUT}/epoch=9-step=10.ckpt)" in hint and "SLURM_NTASKS" in hint
    resumed = _requeued_job(10)
    assert started_over_hints(resumed, compute(resumed, 52.0, supervisor_alive=False)) == []
