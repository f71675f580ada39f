"""Step tails (`ettr.steptail`): the steps a killed process took but never wrote are recovered after its
attempt, so that lost steps are exact after a SIGKILL or a SIGTERM without a handler."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.steptail import RING_SLOTS, StepTail, read_tails, tail_events, tail_path, unrecorded_steps
from framework_truth import report, run_ettr


def test_a_tail_keeps_the_last_steps_of_its_attempt(tmp_path: Path) -> None:
    tail = StepTail(tail_path(tmp_path, rank=3, pid=11))
    for step in range(1, 11):
        tail.note(0, step)
    (steps,) = read_tails(tmp_path, 0).values()
    assert [s for s, _ in steps] == list(range(1, 11))
    assert [ts for _, ts in steps] == sorted(ts for _, ts in steps)
    assert list(read_tails(tmp_path, 0)) == [3] and read_tails(tmp_path, 1) == {}
    for step in range(11, 11 + 2 * RING_SLOTS):  # a long attempt: the ring holds the newest
        tail.note(0, step)
    (steps,) = read_tails(tmp_path, 0).values()
    assert [s for s, _ in steps] == list(range(11 + RING_SLOTS, 11 + 2 * RING_SLOTS))
    tail.note(1, 500)  # restarted in place: a fresh ring for the new attempt
    assert read_tails(tmp_path, 0) == {} and [s for s, _ in read_tails(tmp_path, 1)[3]] == [500]


def test_what_the_books_lack_is_what_is_after_each_ranks_last_recorded_step() -> None:
    tails = {0: [(4, 1.0), (5, 2.0), (6, 3.0)], 1: [(5, 2.5), (6, 0.5)], 2: [(1, 9.0)]}
    recorded = [(0, 4, 1.0), (0, 5, 2.0), (1, 5, 2.5)]
    # rank 1's step 6 is older than its recorded step 5: a slot cut short, dropped; rank 2 recorded nothing
    assert unrecorded_steps(tails, recorded) == [(0, 6, 3.0), (2, 1, 9.0)]
    assert unrecorded_steps({}, recorded) == []


def test_foreign_or_short_files_in_the_tail_directory_are_ignored(tmp_path: Path) -> None:
    tail = StepTail(tail_path(tmp_path, rank=0, pid=1))
    tail.note(0, 7)
    folder = tail_path(tmp_path, rank=0, pid=1).parent
    (folder / "rank-1-pid-2").write_bytes(b"short")
    (folder / "rank-2-pid-3").write_bytes(bytes(4096))  # no header
    (folder / "notes.txt").write_text("hello")
    assert {rank: [s for s, _ in steps] for rank, steps in read_tails(tmp_path, 0).items()} == {0: [7]}


@pytest.mark.parametrize("ts", [float("inf"), 1e300, 1.0])
def test_a_tail_step_outside_its_attempt_is_no_step(tmp_path: Path, monkeypatch, ts: float) -> None:
    """A tail is a file in the run directory: a step dated infinity made the report's wall time NaN (a
    traceback from `ettr report`, null numbers in its JSON); 1e300 or 1970 stretched it by centuries."""
    start = time.time() - 60.0
    events = [Event(EventKind.ATTEMPT_START, start, 0, SUPERVISOR_RANK, data={"pid": 1})]
    tail = StepTail(tail_path(tmp_path, rank=0, pid=1))
    tail.note(0, 7)
    monkeypatch.setattr(time, "time", lambda: ts)
    tail.note(0, 8)
    monkeypatch.undo()
    assert [e.step for e in tail_events(tmp_path, 0, events)] == [7]
    assert all(start <= e.ts <= time.time() for e in tail_events(tmp_path, 0, events))


KILLED_AFTER_ITS_STEPS = """
import json, os, signal, sys, torch
log = open(sys.argv[1], "w")
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 41):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    log.write(json.dumps({"step": step}) + "\\n"); log.flush()
os.kill(os.getpid(), signal.SIG%s)  # at once, as a scheduler's SIGTERM to a script without a handler
"""


@pytest.mark.parametrize("sig", ["KILL", "TERM"])
def test_steps_a_killed_process_never_wrote_are_on_the_books(tmp_path: Path, sig: str) -> None:
    pytest.importorskip("torch")
    script, seen, run_dir = tmp_path / "train.py", tmp_path / "seen.jsonl", tmp_path / "run"
    script.write_text(KILLED_AFTER_ITS_STEPS % sig)
    done = run_ettr(
        "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--", sys.executable, str(script), str(seen)
    )
    assert done.returncode != 0, done.stderr[-2000:]
    last_seen = json.loads(seen.read_text().splitlines()[-1])["step"]
    rep = report(run_dir)
    (attempt,) = rep["attempts"]
    assert last_seen == 40 and attempt["last_step"] == last_seen, done.stderr[-2000:]
    assert attempt["num_steps"] == 40


def test_a_killed_supervisors_open_attempt_has_the_steps_its_processes_kept(tmp_path: Path) -> None:
    """SIGKILL to `ettr run`: its training process dies with it (PDEATHSIG) after steps its recorder had not
    written yet (it writes every 0.5 s), perhaps after saving a checkpoint of one of them. The report reads
    them from the tail, and the next supervisor records them before it closes the attempt."""
    from ettr.events import SUPERVISOR_RANK, Event, EventKind
    from ettr.ledger import open_ledger, read_run_events
    from ettr.report.load import read_run

    run_dir = tmp_path / "run"
    ledger = open_ledger(run_dir)
    dead = {"pid": 2**22 + 12345, "job_id": "j"}  # above any pid this machine hands out
    began = time.time() - 60  # the books' times are checked against the clock: a recent run
    ledger.append(
        [
            Event(EventKind.SUPERVISOR_START, began, 0, SUPERVISOR_RANK, data=dead),
            Event(EventKind.ATTEMPT_START, began + 0.5, 0, SUPERVISOR_RANK, data={"pid": 2**22 + 12346}),
            *(Event(EventKind.STEP, began + 1.0 + i, 0, 0, step=i + 1) for i in range(14)),
        ]
    )
    ledger.close()
    tail = StepTail(tail_path(run_dir, rank=0, pid=2**22 + 12346))
    for step in range(1, 17):  # two more than the books hold
        tail.note(0, step)
    _, rep = read_run(run_dir)
    assert rep.attempts[0].last_step == 16
    assert max(e.step or 0 for e in read_run_events(run_dir)) == 14  # the report only read them

    done = run_ettr("run", "--run-dir", str(run_dir), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stderr
    events = read_run_events(run_dir)
    kept = [
        e.step for e in events if e.kind is EventKind.STEP and (e.data or {}).get("source") == "step_tail"
    ]
    assert kept == [15, 16]
    (closed,) = [e for e in events if e.kind is EventKind.ATTEMPT_END and e.attempt == 0]
    assert (closed.data or {}).get("closed_from_ledger") is True
    assert closed.ts >= max(e.ts for e in events if e.kind is EventKind.STEP)  # after the steps it kept
    assert report(run_dir)["attempts"][0]["last_step"] == 16


def test_a_tail_without_room_on_disk_stays_off_instead_of_mapping_a_hole(tmp_path: Path, monkeypatch) -> None:
    """On a full file system the page must be allocated before it is mapped: a hole (what `ftruncate` made)
    is filled by the first write through the map, and on a full tmpfs that write was a SIGBUS that killed
    the training process at its first step. The allocation's ENOSPC turns the tail off; training goes on."""
    import errno
    import os

    import ettr.steptail as steptail

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(steptail.os, "pwrite", full, raising=False)
    tail = StepTail(tail_path(tmp_path, 0, pid=1), run_dir=tmp_path)
    tail.note(0, 1)  # no map: nothing to fault on
    tail.note(0, 2)
    assert tail._map is None and tail._off
    monkeypatch.setattr(steptail.os, "pwrite", lambda fd, data, offset: 100)  # a short write: no room either
    short = StepTail(tail_path(tmp_path, 0, pid=2), run_dir=tmp_path)
    short.note(0, 1)
    assert short._map is None
    monkeypatch.undo()
    ok = StepTail(tail_path(tmp_path, 0, pid=3), run_dir=tmp_path)
    ok.note(0, 1)
    assert ok._map is not None and os.stat(tail_path(tmp_path, 0, pid=3)).st_blocks > 0  # storage, not a hole
    assert read_tails(tmp_path, 0)[0] == [(1, pytest.approx(time.time(), abs=3600))]


_FULL_TMPFS_CHILD = """
import sys
from pathlib import Path
from ettr.steptail import StepTail, tail_path
run_dir = Path(sys.argv[1])
tail = StepTail(tail_path(run_dir, 0), run_dir=run_dir)
for step in range(1, 50):
    tail.note(0, step)
print("alive", tail._map is None)
"""


def test_a_step_tail_on_a_really_full_tmpfs_does_not_kill_the_process(tmp_path: Path) -> None:
    """The real thing where a tmpfs can be mounted (root with CAP_SYS_ADMIN): fill a 1 MiB tmpfs, then take
    steps in a child: it lives, its tail off (it died of SIGBUS before)."""
    import os
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, bytes(4096)) == 4096:
                pass
        except OSError:
            pass  # full
        finally:
            os.close(fd)
        run_dir = mnt / "run"
        run_dir.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", _FULL_TMPFS_CHILD, str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert done.stdout.split() == ["alive", "True"]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_process_that_died_before_its_first_flush_keeps_its_steps(tmp_path: Path) -> None:
    """It wrote nothing to the books (no PROCESS_START, no STEP: its recorder flushes every 0.5 s) and its
    tail's steps were dropped as taken "before its attempt began" (no event of the attempt to date it from):
    the attempt read `user (startup)`, its progress lost. The supervisor gives the attempt's start."""
    start = time.time() - 5.0
    tail = StepTail(tail_path(tmp_path, rank=0, pid=12))
    for step in (201, 202, 203):
        tail.note(6, step)
    assert tail_events(tmp_path, 6, []) == []  # nothing to date the attempt from: no step, as before
    found = tail_events(tmp_path, 6, [], since=start)
    assert [(e.step, e.rank, e.attempt) for e in found] == [(201, 0, 6), (202, 0, 6), (203, 0, 6)]
    assert tail_events(tmp_path, 6, [], since=time.time() + 60.0) == []  # taken before it began: no step
