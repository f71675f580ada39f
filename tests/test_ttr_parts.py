"""TTR and TTS broken into parts (`ettr.accounting.ttr`): pure, from hand-made events."""

from __future__ import annotations

import json
import math

import pytest

from ettr.accounting import compute
from ettr.accounting.ttr import RECOVERY_PARTS, STARTUP_PARTS
from ettr.constants import BACKOFF_MARK, FAILURE_DETECTED_MARK, IMPORTS_MARK
from ettr.events import SUPERVISOR_RANK, Event, EventKind, Phase
from ettr.report import json as report_json
from ettr.report import text as report_text
from ettr.report.html import render_html

S = SUPERVISOR_RANK


def sup(kind: EventKind, ts: float, attempt: int, **data: object) -> Event:
    return Event(kind, ts, attempt, S, data=data or None)


def mark(ts: float, attempt: int, rank: int, name: str) -> Event:
    return Event(EventKind.MARK, ts, attempt, rank, data={"name": name})


def phase(name: Phase, begin: float, end: float, attempt: int, rank: int = 0) -> list[Event]:
    return [
        Event(EventKind.PHASE_BEGIN, begin, attempt, rank, phase=name),
        Event(EventKind.PHASE_END, end, attempt, rank, phase=name, value=begin),
    ]


def attempt_events(attempt: int, t0: float, *, steps: range, imports: bool = True) -> list[Event]:
    """One rank-0 start-up: process start t0+1, imports t0+3, pg t0+3..4, restore 4.5..5, first step 6."""
    ev = [Event(EventKind.PROCESS_START, t0 + 1, attempt, 0, data={"pid": 1})]
    if imports:
        ev.append(mark(t0 + 3, attempt, 0, IMPORTS_MARK))
    ev += phase(Phase.PROCESS_GROUP_INIT, t0 + 3, t0 + 4, attempt)
    ev += phase(Phase.RESTORE, t0 + 4.5, t0 + 5, attempt)
    ev.append(Event(EventKind.TRAINING_START, t0 + 5.5, attempt, 0))
    ev += [Event(EventKind.STEP, t0 + 6 + i * 0.1, attempt, 0, step=s) for i, s in enumerate(steps)]
    return ev


def job(*, detected: bool = True, backoff: bool = True, failure: bool = True) -> list[Event]:
    ev = [sup(EventKind.SUPERVISOR_START, 0.0, 0), sup(EventKind.ATTEMPT_START, 0.0, 0)]
    ev += attempt_events(0, 0.0, steps=range(1, 11))
    if failure:
        ev.append(Event(EventKind.FAILURE, 7.0, 0, 1, data={"exception": "RuntimeError"}))
    if detected:
        ev.append(mark(7.25, 0, S, FAILURE_DETECTED_MARK))
    ev.append(sup(EventKind.ATTEMPT_END, 7.5, 0, outcome="failed", exit_code=1))
    if backoff:
        ev.append(mark(8.0, 0, S, BACKOFF_MARK))
    ev.append(sup(EventKind.ATTEMPT_START, 8.25, 1))
    ev += attempt_events(1, 8.25, steps=range(6, 11))
    ev.append(sup(EventKind.ATTEMPT_END, 20.0, 1, outcome="completed", exit_code=0))
    ev.append(sup(EventKind.JOB_END, 20.0, 1, exit_status=0))
    return ev


def test_recovery_parts_follow_the_milestones_and_add_up():
    report = compute(job(), now=30.0)
    (parts,) = report.ttr_parts
    assert (parts.failed_attempt, parts.recovered_attempt) == (0, 1)
    assert list(parts.parts_s) == list(RECOVERY_PARTS)
    expected = {
        "detection": 0.25,
        "teardown": 0.25,
        "backoff": 0.5,
        "relaunch": 1.25,  # back-off end 8.0 -> process start 9.25
        "imports": 2.0,
        "compile": 0.0,
        "restore": 0.5,
        "first_batch": 0.0,
        "process_group": 1.0,
        "evaluation": 0.0,
        "other_init": 1.0,  # 12.25..12.75 and 13.25..13.75: the script's own set-up
        "first_step": 0.5,
    }
    assert parts.parts_s == pytest.approx(expected)
    assert parts.start_ts == 7.0 and parts.first_step_ts == pytest.approx(14.25)
    assert math.fsum(v for v in parts.parts_s.values() if v is not None) == pytest.approx(parts.total_s)
    # The contract's TTR is the part from ATTEMPT_END to the training start.
    contract = sum(parts.parts_s[n] for n in RECOVERY_PARTS[2:-1])  # type: ignore[misc]
    assert report.ttr_s == (pytest.approx(contract),)


def test_tts_parts():
    report = compute(job(), now=30.0)
    tts = report.tts_parts
    assert tts is not None and list(tts.parts_s) == list(STARTUP_PARTS)
    assert tts.parts_s["launch"] == pytest.approx(1.0)
    assert tts.parts_s["imports"] == pytest.approx(2.0)
    assert tts.parts_s["process_group"] == pytest.approx(1.0)
    assert tts.total_s == pytest.approx(6.0)


def test_an_injected_kill_dates_the_failure_its_detection_is_known():
    # `--inject kill` leaves no FAILURE but its own `inject` MARK, flushed just before the SIGKILL.
    injected = Event(
        EventKind.MARK, 7.0, 0, 1, data={"name": "inject", "spec": "kill@step=10,attempt=0,rank=1"}
    )
    (parts,) = compute([*job(failure=False), injected], now=30.0).ttr_parts
    assert parts.parts_s["detection"] == pytest.approx(0.25) and parts.start_ts == 7.0


def test_missing_milestones_give_their_time_to_the_next_part_and_unknown_failure_is_none():
    (parts,) = compute(job(detected=False, backoff=False, failure=False), now=30.0).ttr_parts
    assert parts.parts_s["detection"] is None  # a SIGKILLed rank records no failure: unknown, not 0
    assert parts.parts_s["teardown"] == 0.0  # detection = ATTEMPT_END without the supervisor's mark
    assert parts.parts_s["backoff"] == pytest.approx(0.75)  # ATTEMPT_END -> ATTEMPT_START
    assert parts.parts_s["relaunch"] == pytest.approx(1.0)
    assert parts.start_ts == 7.5
    assert math.fsum(v for v in parts.parts_s.values() if v is not None) == pytest.approx(parts.total_s)


def test_without_imports_mark_its_time_goes_to_the_in_process_parts():
    events = [
        e for e in job() if not (e.kind == EventKind.MARK and e.data and e.data["name"] == IMPORTS_MARK)
    ]
    (parts,) = compute(events, now=30.0).ttr_parts
    assert parts.parts_s["imports"] == 0.0
    assert parts.parts_s["other_init"] == pytest.approx(3.0)


def test_a_program_that_launched_the_ranks_gives_its_start_and_imports_to_the_launch():
    # `ettr run -- bash run.sh` running `fabric run --devices 2 train.py` (torchrun's agent in-process): the
    # CLI is instrumented as rank 0 (world size 1) before it becomes the launcher; the workers start at 4.
    # Before 2026-12-05 the TTS read `imports 1.0` (the CLI's) and the workers' own imports as other_init.
    events = [
        sup(EventKind.SUPERVISOR_START, 0.0, 0),
        sup(EventKind.ATTEMPT_START, 0.0, 0),
        Event(EventKind.PROCESS_START, 0.5, 0, 0, data={"pid": 10, "world_size": 1}),
        mark(1.5, 0, 0, IMPORTS_MARK),
        Event(EventKind.PROCESS_START, 4.0, 0, 1, data={"pid": 12, "world_size": 2}),
        Event(EventKind.PROCESS_START, 4.25, 0, 0, data={"pid": 11, "world_size": 2}),
        mark(6.0, 0, 1, IMPORTS_MARK),
        mark(6.25, 0, 0, IMPORTS_MARK),
        Event(EventKind.TRAINING_START, 8.0, 0, 0),
        *[Event(EventKind.STEP, 8.5 + i * 0.5, 0, 0, step=i + 1) for i in range(4)],
        sup(EventKind.ATTEMPT_END, 11.0, 0, outcome="completed", exit_code=0),
        sup(EventKind.JOB_END, 11.0, 0, exit_status=0),
    ]
    tts = compute(events, now=12.0).tts_parts
    assert tts is not None
    assert tts.parts_s["launch"] == pytest.approx(4.0)  # the program's start, imports and its workers' spawn
    assert tts.parts_s["imports"] == pytest.approx(2.25)  # rank 0's worker: 4.0 (the first worker) -> 6.25
    assert tts.parts_s["other_init"] == pytest.approx(1.75)
    assert tts.headline_s == pytest.approx(8.0)


def test_the_evaluation_a_resume_repeats_before_its_first_step_is_its_own_part():
    events = job() + phase(Phase.EVAL, 13.25, 13.75, 1)  # nanoGPT evaluates again at the resumed iteration
    (parts,) = compute(events, now=30.0).ttr_parts
    assert parts.parts_s["evaluation"] == pytest.approx(0.5)
    assert parts.parts_s["other_init"] == pytest.approx(0.5)
    assert math.fsum(v for v in parts.parts_s.values() if v is not None) == pytest.approx(parts.total_s)


def test_overlapping_phases_are_counted_once_compile_first():
    events = job() + phase(Phase.COMPILE, 12.5, 13.5, 1)  # overlaps the restore 12.75..13.25
    (parts,) = compute(events, now=30.0).ttr_parts
    assert parts.parts_s["compile"] == pytest.approx(1.0)
    assert parts.parts_s["restore"] == pytest.approx(0.0)
    assert math.fsum(v for v in parts.parts_s.values() if v is not None) == pytest.approx(parts.total_s)


def test_out_of_order_clocks_never_give_negative_parts():
    events = job() + [mark(30.0, 1, 0, "late")]
    skewed = [
        Event(e.kind, 5.0, e.attempt, e.rank, data=e.data)
        if e.kind == EventKind.PROCESS_START and e.attempt == 1
        else e
        for e in events
    ]
    (parts,) = compute(skewed, now=40.0).ttr_parts
    assert all(v is None or v >= 0 for v in parts.parts_s.values())


def test_no_recovery_no_parts_and_renderers_show_them():
    only_first = [e for e in job() if e.attempt == 0 and e.kind != EventKind.ATTEMPT_END]
    assert compute(only_first, now=30.0).ttr_parts == ()
    report = compute(job(), now=30.0)
    data = json.loads(json.dumps(report_json.to_dict(report)))
    assert data["ttr_parts"][0]["parts_s"]["backoff"] == pytest.approx(0.5)
    assert data["tts_parts"]["total_s"] == pytest.approx(6.0)
    assert data["ttr_s"] == [pytest.approx(report.ttr_s[0])]  # the contract's keys stay as they were
    text = report_text.render(report)
    assert "recover by part" in text and "relaunch" in text
    assert 'class="parts"' in render_html([report])


def test_the_headline_and_the_table_show_one_ttr_each_labelled():
    """The headline's TTR (failed attempt's end -> training start) is a row of the parts table, equal to it;
    the table's total (failure -> first step) is labelled as such, in text, HTML and JSON."""
    report = compute(job(), now=30.0)
    (parts,) = report.ttr_parts
    assert parts.headline_s == pytest.approx(report.ttr_s[0]) == pytest.approx(14.0 - 7.5 - 0.25)
    assert report.tts_parts is not None and report.tts_parts.headline_s == pytest.approx(report.tts_s)
    assert parts.total_s == pytest.approx(7.25) and parts.failure_known
    data = json.loads(json.dumps(report_json.to_dict(report)))
    entry = data["ttr_parts"][0]
    assert entry["headline_s"] == pytest.approx(data["ttr_s"][0])
    assert entry["headline_measures"] == data["ttr_measures"] and "training start" in data["ttr_measures"]
    assert entry["total_measures"] == "failure -> first step"
    assert data["tts_parts"]["headline_s"] == pytest.approx(data["tts_s"])
    text = report_text.render(report)
    row = next(line for line in text.splitlines() if line.strip().startswith("= TTS / TTR (headline)"))
    assert row.split()[-2:] == ["5.50", "6.25"]  # TTS 5.5 and TTR 6.25, as in the summary line
    assert "TTS 5.5 s | TTR 6.2 s" in report_text.summary_line(report)
    page = render_html([report])
    assert "= TTS / TTR (headline)" in page and "failed attempt&#x27;s end" in page
    # Without a recorded failure the whole starts at the detection, and says so.
    (unknown,) = compute(job(detected=False, backoff=False, failure=False), now=30.0).ttr_parts
    assert not unknown.failure_known
    assert report_json.to_dict(compute(job(failure=False), now=30.0))["ttr_parts"][0]["total_measures"] == (
        "failure detected -> first step (failure time unknown)"
    )


def test_each_recovery_says_how_it_was_recovered():
    """cold by default; warm when the relaunch took standbys; in_place when the agent said so at the attempt's
    start; requeue when a new supervisor run came between the two attempts (it wins over the relaunch path)."""
    from ettr.accounting.ttr import RECOVERY_KINDS
    from ettr.constants import RECOVERY_MARK, RELAUNCH_MARK

    assert [p.kind for p in compute(job(), now=30.0).ttr_parts] == ["cold_restart"]
    assert compute(job(), now=30.0).tts_parts.kind is None

    warm = job() + [
        Event(EventKind.MARK, 8.3, 1, S, data={"name": RELAUNCH_MARK, "path": "warm", "why": "x"})
    ]
    assert [p.kind for p in compute(warm, now=30.0).ttr_parts] == ["warm_restart"]
    in_place = job() + [Event(EventKind.MARK, 8.3, 1, S, data={"name": RECOVERY_MARK, "kind": "in_place"})]
    assert [p.kind for p in compute(in_place, now=30.0).ttr_parts] == ["in_place"]
    requeued = warm + [sup(EventKind.SUPERVISOR_START, 8.0, 0)]
    assert [p.kind for p in compute(requeued, now=30.0).ttr_parts] == ["requeue"]
    found = report_json.to_dict(compute(in_place, now=30.0))
    assert [p["kind"] for p in found["ttr_parts"]] == ["in_place"] and found["tts_parts"]["kind"] is None
    assert all(
        p["kind"] in RECOVERY_KINDS for p in report_json.to_dict(compute(requeued, now=30.0))["ttr_parts"]
    )
    text = "\n".join(report_text.render(compute(in_place, now=30.0)).splitlines())
    assert "recovery kind" in text and "in_place" in text
    assert "in_place" in render_html([compute(in_place, now=30.0)])


def test_a_requeues_wait_in_the_queue_is_its_scheduling_part_not_backoff():
    """Field trial (Slurm, nanoGPT requeued by `scontrol requeue`): the requeued run pended 174 s in the queue,
    booked `scheduling` in the buckets, but the TTR table called it `backoff 175.62` (the supervisor's own
    wait). A requeued run that recorded its submission and allocation splits the wait as the buckets do;
    one that did not leaves it all backoff, with no new parts."""
    from ettr.accounting.ttr import ALL_RECOVERY_PARTS, REQUEUE_PARTS
    from ettr.events import Bucket

    def requeued(**times: float) -> list[Event]:
        return job(backoff=False) + [sup(EventKind.SUPERVISOR_START, 8.0, 0, **times)]

    report = compute(requeued(submitted_at=7.6, allocated_at=7.9), now=30.0)
    (parts,) = report.ttr_parts
    assert parts.kind == "requeue"
    assert list(parts.parts_s) == list(ALL_RECOVERY_PARTS)
    got = {n: parts.parts_s[n] for n in ("backoff", *REQUEUE_PARTS, "relaunch")}
    assert got == pytest.approx({"backoff": 0.1, "scheduling": 0.3, "hardware_setup": 0.1, "relaunch": 1.25})
    assert parts.parts_s["scheduling"] == pytest.approx(report.attempts[1].buckets_s[Bucket.SCHEDULING])
    assert math.fsum(v for v in parts.parts_s.values() if v is not None) == pytest.approx(parts.total_s)
    assert report.ttr_s == (pytest.approx(parts.headline_s),)
    assert parts.headline_s == pytest.approx(math.fsum(parts.parts_s[n] for n in ALL_RECOVERY_PARTS[2:-1]))
    text = report_text.render(report)
    assert "  scheduling " in text.split("time to start / recover by part")[1]
    assert report_json.to_dict(report)["ttr_parts"][0]["parts_s"]["scheduling"] == pytest.approx(0.3)

    (allocated_only,) = compute(requeued(allocated_at=7.9), now=30.0).ttr_parts  # SubmitTime not read
    assert allocated_only.parts_s["scheduling"] is None  # unknown, not 0: the wait is in backoff
    assert (allocated_only.parts_s["backoff"], allocated_only.parts_s["hardware_setup"]) == pytest.approx(
        (0.4, 0.1)
    )
    assert "?" in report_text.render(compute(requeued(allocated_at=7.9), now=30.0))
    (unknown,) = compute(requeued(), now=30.0).ttr_parts
    assert list(unknown.parts_s) == list(RECOVERY_PARTS) and unknown.parts_s["backoff"] == pytest.approx(0.75)
    plain = report_text.render(compute(job(), now=30.0))
    assert "  scheduling " not in plain.split("time to start / recover by part")[1]


def test_a_requeue_after_a_restart_books_none_of_the_restarted_attempt_as_the_queues_wait():
    """Field trial: a crash restarted in the allocation (attempt 1), then `scontrol requeue` 0.2 s into
    attempt 1. Slurm's SubmitTime has whole seconds: it said the wait began before attempt 1 ended, and the
    recovery 0->2 took attempt 1's life for `scheduling` (7.79 s beside the bucket's 7.61 s)."""
    ev = [sup(EventKind.SUPERVISOR_START, 0.0, 0), sup(EventKind.ATTEMPT_START, 0.0, 0)]
    ev += attempt_events(0, 0.0, steps=range(1, 11))
    ev.append(sup(EventKind.ATTEMPT_END, 7.5, 0, outcome="failed", exit_code=1))
    ev += [sup(EventKind.ATTEMPT_START, 7.6, 1), sup(EventKind.ATTEMPT_END, 8.0, 1, outcome="preempted")]
    ev.append(sup(EventKind.SUPERVISOR_START, 9.0, 0, submitted_at=7.0, allocated_at=8.5))
    ev.append(sup(EventKind.ATTEMPT_START, 9.25, 2))
    ev += attempt_events(2, 9.25, steps=range(6, 11))
    ev.append(sup(EventKind.ATTEMPT_END, 20.0, 2, outcome="completed", exit_code=0))
    ev.append(sup(EventKind.JOB_END, 20.0, 2, exit_status=0))
    report = compute(ev, now=30.0)
    from ettr.events import Bucket

    assert [(p.failed_attempt, p.recovered_attempt) for p in report.ttr_parts] == [(0, 2), (1, 2)]
    assert [p.parts_s["scheduling"] for p in report.ttr_parts] == pytest.approx([0.5, 0.5])
    assert report.attempts[2].buckets_s[Bucket.SCHEDULING] == pytest.approx(0.5)
    first = report.ttr_parts[0]
    assert math.fsum(v for v in first.parts_s.values() if v is not None) == pytest.approx(first.total_s)


def test_a_long_recovery_kind_stays_in_its_own_column():
    """`cold_restart` is 12 characters: in 10-wide columns two recoveries read `cold_restartcold_restart`
    and the kind stood out of its column (right-aligned under nothing)."""
    from ettr.report.ttr_parts import text_lines

    lines = text_lines(compute(job(), now=30.0))
    (header,) = [line for line in lines if line.rstrip().endswith("0->1")]
    (kinds,) = [line for line in lines if line.lstrip().startswith("recovery kind")]
    assert kinds.rstrip().endswith(" cold_restart") and len(kinds.rstrip()) == len(header.rstrip())
    (total,) = [line for line in lines if line.lstrip().startswith("total (to first step)")]
    assert len(total.rstrip()) == len(header.rstrip())


def test_each_recovery_says_where_its_ranks_restored_from():
    """The checkpoint manager records RESTORE with `source` (memory, peer, storage); the report said none of
    it, so a user could not tell from the books whether a restart was restored from memory."""
    from ettr.report.ttr_parts import RESTORED_FROM_ROW, text_lines

    def restored(source: str, rank: int) -> Event:
        return Event(
            EventKind.PHASE_END, 12.9, 1, rank, phase=Phase.RESTORE, value=12.8, data={"source": source}
        )

    (unknown,) = compute(job(), now=30.0).ttr_parts  # a restore without a source: not ettr's manager
    assert unknown.restored_from is None
    memory = compute(job() + [restored("memory", 0), restored("memory", 1)], now=30.0)
    assert memory.ttr_parts[0].restored_from == "memory"
    assert report_json.to_dict(memory)["ttr_parts"][0]["restored_from"] == "memory"
    assert report_json.to_dict(memory)["tts_parts"]["restored_from"] is None
    (row,) = [line for line in text_lines(memory) if line.startswith("  " + RESTORED_FROM_ROW)]
    assert row.split()[-1] == "memory"
    assert "memory" in render_html([memory])
    node = compute(job() + [restored("memory", 0), restored("peer", 1)], now=30.0)
    assert node.ttr_parts[0].restored_from == "memory+peer"
    (row,) = [line for line in text_lines(compute(job(), now=30.0)) if RESTORED_FROM_ROW in line]
    assert row.split()[-1] == "?"


def test_a_recovery_that_read_storage_beside_its_memory_copies_says_why():
    """A restart on a node that survived read storage (a rank's copy was stale: killed between a commit and
    its copy); the books said `storage` and nothing else, as for a job without memory copies."""
    from ettr.report.ttr_parts import text_lines

    own = "rank 1: memory copy not used: it holds step 325, the newest commit is step 350 (stale)"

    def restored(rank: int, why: str) -> Event:
        data = {"source": "storage", "memory_not_used": why}
        return Event(EventKind.PHASE_END, 12.9, 1, rank, phase=Phase.RESTORE, value=12.8, data=data)

    report = compute(
        job() + [restored(0, "another rank had no usable copy of step 350"), restored(1, own)], now=30.0
    )
    assert report.ttr_parts[0].restored_why == own
    assert report_json.to_dict(report)["ttr_parts"][0]["restored_why"] == own
    assert f"  restore 0->1: storage, not memory ({own})" in text_lines(report)
    assert own in render_html([report])
    plain = compute(
        job() + [Event(EventKind.PHASE_END, 12.9, 1, 0, phase=Phase.RESTORE, data={"source": "memory"})],
        now=30.0,
    )
    assert plain.ttr_parts[0].restored_why is None
    assert not [line for line in text_lines(plain) if line.startswith("  restore 0->1:")]


def test_the_fleet_counts_recoveries_by_kind():
    from ettr.constants import RECOVERY_MARK
    from ettr.fleet.aggregate import totals
    from ettr.fleet.json import job_dict, totals_dict
    from ettr.fleet.model import summarize, summary_from_json, summary_to_json

    in_place = job() + [Event(EventKind.MARK, 8.3, 1, S, data={"name": RECOVERY_MARK, "kind": "in_place"})]
    jobs = [
        summarize(
            compute(events, now=30.0), family="f", source=name, gpus=2, gpus_source="ranks", running=False
        )
        for name, events in (("a", job()), ("b", in_place))
    ]
    assert [j.recoveries for j in jobs] == [(("cold_restart", 6.25),), (("in_place", 6.25),)]
    assert summary_from_json(json.loads(json.dumps(summary_to_json(jobs[1])))) == jobs[1]
    assert job_dict(jobs[1])["recoveries"] == [{"kind": "in_place", "ttr_s": 6.25}]
    by_kind = totals_dict(totals(jobs))["ttr_s_by_kind"]
    assert sorted(by_kind) == ["cold_restart", "in_place"] and by_kind["in_place"]["count"] == 1


def test_a_recovery_that_restored_nothing_says_so_and_unknown_stays_unknown():
    """A restart that resumed from no step (it started over: the attempts table's `-`) read `(restored from) ?`
    in the text, null in the JSON and `?` in the HTML, as if where it restored from were unknown."""
    from ettr.report.ttr_parts import RESTORED_FROM_ROW, text_lines

    over = [e for e in job() if not (e.attempt == 1 and e.kind is EventKind.STEP)]
    over += [Event(EventKind.STEP, 14.25 + i * 0.1, 1, 0, step=s) for i, s in enumerate(range(1, 11))]
    report = compute(sorted(over, key=lambda e: e.ts), now=30.0)
    assert report.attempts[1].resumed_from_step is None
    assert report.ttr_parts[0].restored_from == "nothing"
    assert report_json.to_dict(report)["ttr_parts"][0]["restored_from"] == "nothing"
    (row,) = [line for line in text_lines(report) if RESTORED_FROM_ROW in line]
    assert row.split()[-1] == "nothing"
    assert "<td>nothing</td>" in render_html([report])
    # It said it resumed, from a step ettr could not place: where from is unknown, not nothing.
    placed = over + [Event(EventKind.RESUMED, 12.95, 1, 0, data={"unknown": "torch.load of an unknown file"})]
    unknown = compute(sorted(placed, key=lambda e: e.ts), now=30.0)
    assert unknown.attempts[1].resumed_step_unknown
    assert unknown.ttr_parts[0].restored_from is None
    assert report_json.to_dict(unknown)["ttr_parts"][0]["restored_from"] is None


def test_a_recovery_that_restored_a_memory_tier_commit_says_which_step_and_what_storage_had():
    """A memory-tier commit (`CheckpointConfig.memory_interval`) is newer than storage's newest: the books say
    where the lost progress began (the step) and what storage alone would have given."""
    from ettr.report.ttr_parts import text_lines

    def restored(rank: int) -> Event:
        data = {"source": "memory", "tier": "memory", "storage_step": 1650}
        return Event(
            EventKind.PHASE_END, 12.9, 1, rank, phase=Phase.RESTORE, value=12.8, step=1690, data=data
        )

    report = compute(job() + [restored(0), restored(1)], now=30.0)
    tier = "a memory-only commit of step 1690; storage had 1650"
    assert report.ttr_parts[0].restored_from == "memory"  # the source, as before
    assert report.ttr_parts[0].restored_tier == tier
    assert report_json.to_dict(report)["ttr_parts"][0]["restored_tier"] == tier
    assert f"  restore 0->1: memory ({tier})" in text_lines(report)
    plain = compute(
        job() + [Event(EventKind.PHASE_END, 12.9, 1, 0, phase=Phase.RESTORE, data={"source": "memory"})],
        now=30.0,
    )
    assert plain.ttr_parts[0].restored_tier is None
    assert report_json.to_dict(plain)["ttr_parts"][0]["restored_tier"] is None
