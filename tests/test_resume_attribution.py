"""A resume is attributed to a step only when the loaded file is the one a recorded save left: several ranks or
attempts saving one path, a file rewritten by a writer ettr did not see, or replaced, give an unknown step (or
the checkpoint's own step key), never another save's step."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ettr.bootstrap.checkpoint_identity import IDENTITY_KEY, Attribution, SaveIndex, file_identity
from ettr.events import Event, EventKind, split_failure_message
from ettr.ledger import open_ledger
from ettr.recorder import Recorder

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "tests" / "scripts" / "train_shared_ckpt.py"


def _ettr(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "ettr.cli", *args], env=env, capture_output=True, text=True, timeout=400
    )


@pytest.mark.slow
def test_two_ranks_saving_one_path_never_give_the_earlier_writers_step(tmp_path: Path) -> None:
    out, run_dir, ckpt = tmp_path / "out", tmp_path / "run", tmp_path / "shared.pt"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = _ettr(
        "run",
        "--run-dir",
        str(run_dir),
        "--max-restarts",
        "1",
        "--",
        *torchrun,
        str(SHARED),
        str(out),
        str(ckpt),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "loaded-1-0").read_text() == "rank 1 at step 4"  # the last writer won on disk
    rep = _ettr("report", str(run_dir), "--json")
    assert rep.returncode == 0, rep.stderr
    second = json.loads(rep.stdout)["attempts"][1]
    # rank 1's commit may or may not have reached the books before its SIGKILL: with it, the file is tied to
    # rank 1's save (step 4); without it, nothing recorded is the file on disk, and the step is unknown.
    assert second["resumed_from_step"] != 2, second
    if second["resumed_step_unknown"] is None:
        assert (second["resumed_from_step"], second["last_step"]) == (4, 6), second
    else:
        assert second["resumed_from_step"] is None and second["lost_steps_estimated"], second
        text = _ettr("report", str(run_dir))
        assert "attempt 1 resumed from an unknown step" in text.stdout, text.stdout


# -- the attribution logic, pure ------------------------------------------------------------------------------
def _commit(
    step: int, path: str, identity: str | None, *, attempt: int = 0, rank: int = 0, mark: bool = False
) -> Event:
    data = {"path": path} if identity is None else {"path": path, IDENTITY_KEY: identity}
    if mark:
        return Event(
            EventKind.MARK, 1.0, attempt, rank, data={"name": "checkpoint_file", "step": step, **data}
        )
    return Event(EventKind.CHECKPOINT_COMMIT, 1.0, attempt, rank, step=step, data=data)


def _index(*events: Event, attempt: int = 1) -> SaveIndex:
    return SaveIndex.from_events(events, before_attempt=attempt, file_mark="checkpoint_file")


def test_the_save_whose_file_is_on_disk_gives_the_step_whichever_rank_recorded_last() -> None:
    index = _index(_commit(2, "/c/a.pt", "A", rank=0), _commit(4, "/c/a.pt", "B", rank=1, mark=True))
    assert index.attribute("/c/a.pt", "B") == Attribution(4)
    assert index.attribute("/c/a.pt", "A") == Attribution(2)
    index = _index(_commit(4, "/c/a.pt", "B", rank=1), _commit(2, "/c/a.pt", "A", rank=0))  # order is no clue
    assert index.attribute("/c/a.pt", "B") == Attribution(4)


def test_a_file_none_of_the_recorded_saves_left_is_unknown() -> None:
    index = _index(_commit(2, "/c/a.pt", "A", rank=0), _commit(4, "/c/a.pt", "B", rank=1))
    found = index.attribute("/c/a.pt", "C")  # rewritten by an unrecorded save, torn, or replaced
    assert found is not None and found.step is None
    assert "none of the saves recorded" in (found.reason or "") and "steps 2, 4" in (found.reason or "")
    alone = _index(_commit(2, "/c/a.pt", "A")).attribute("/c/a.pt", "C")
    assert alone is not None and alone.step is None  # one candidate is no excuse for a guess


def test_saves_without_an_identity_are_trusted_only_when_they_agree() -> None:
    older = _index(_commit(2, "/c/a.pt", None, rank=0), _commit(4, "/c/a.pt", None, rank=1))  # an older ettr
    found = older.attribute("/c/a.pt", "X")
    assert found is not None and found.step is None and "cannot tell" in (found.reason or "")
    assert _index(_commit(2, "/c/a.pt", None), _commit(2, "/c/a.pt", None, rank=1)).attribute(
        "/c/a.pt", "X"
    ) == Attribution(2)
    remote = _index(_commit(2, "s3://b/a.pt", "A"), _commit(4, "s3://b/a.pt", "B", rank=1))
    unreadable = remote.attribute("s3://b/a.pt", None)  # no identity to compare at the load
    assert unreadable is not None and unreadable.step is None
    assert _index(_commit(2, "s3://b/a.pt", "A")).attribute("s3://b/a.pt", None) == Attribution(2)
    upgraded = _index(_commit(2, "/c/a.pt", None), _commit(4, "/c/a.pt", "B", attempt=1), attempt=2)
    assert upgraded.attribute("/c/a.pt", "B") == Attribution(4)
    rewritten = upgraded.attribute("/c/a.pt", "C")  # not attempt 1's save; nothing says it is attempt 0's
    assert rewritten is not None and rewritten.step is None


def test_the_file_of_a_save_is_that_save_under_another_name_and_twins_are_unknown() -> None:
    index = _index(_commit(2, "/c/a.pt", "A"), _commit(4, "/c/a.pt.tmp1", "B", rank=1))  # rename unrecorded
    assert index.attribute("/c/a.pt", "B") == Attribution(4)
    assert index.attribute("/c/copied.pt", "B") == Attribution(4)
    assert index.attribute("/c/other.pt", "Z") is None  # not a file of this job
    twins = _index(_commit(2, "/c/a.pt", "A"), _commit(4, "/c/b.pt", "A"))
    found = twins.attribute("/c/a.pt", "A")
    assert found is not None and found.step is None


def test_only_earlier_attempts_count_and_the_latest_save_of_several_attempts_is_found() -> None:
    events = [
        _commit(5, "/c/a.pt", "A", attempt=0),
        _commit(8, "/c/a.pt", "B", attempt=1),
        _commit(9, "/c/a.pt", "C", attempt=2),
    ]
    assert _index(*events, attempt=2).attribute("/c/a.pt", "B") == Attribution(8)
    assert _index(*events, attempt=2).attribute("/c/a.pt", "A") == Attribution(5)
    assert "/c/a.pt" in _index(*events, attempt=1) and not _index(*events, attempt=0).by_path


def test_file_identity_follows_the_bytes_and_the_write_not_the_name(tmp_path: Path) -> None:
    first = tmp_path / "a.pt"
    first.write_bytes(b"x" * 300_000)
    identity = file_identity(str(first))
    assert identity is not None and identity == file_identity(str(first))
    os.replace(first, tmp_path / "b.pt")
    assert file_identity(str(tmp_path / "b.pt")) == identity  # a rename keeps it
    stat = os.stat(tmp_path / "b.pt")
    with open(tmp_path / "b.pt", "r+b") as f:
        f.seek(299_000)
        f.write(b"y")  # same size, the tail changed
    os.utime(tmp_path / "b.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the mtime put back
    assert file_identity(str(tmp_path / "b.pt")) != identity
    assert file_identity(str(tmp_path / "gone.pt")) is None and file_identity("s3://bucket/a.pt") is None
    os.mkfifo(tmp_path / "pipe")
    assert file_identity(str(tmp_path / "pipe")) is None and file_identity(os.devnull) is None  # never blocks
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shard")
    before = file_identity(str(folder))
    (folder / "__1_0.distcp").write_bytes(b"shard")
    assert before is not None and file_identity(str(folder)) not in (None, before)
    (folder / ".metadata").write_bytes(b"meta")  # a DCP checkpoint: its .metadata is what the save left
    dcp = file_identity(str(folder))
    assert dcp == file_identity(str(folder / ".metadata"))
    (folder / "notes.json").write_text("{}")  # written beside it by the script afterwards
    assert file_identity(str(folder)) == dcp


torch = pytest.importorskip("torch")


# -- the hooks, in one process: each "rank" or attempt a recorder of its own over one SQLite ledger -------------
@contextlib.contextmanager
def _hooked(run_dir: Path, *, attempt: int, rank: int = 0) -> Iterator[Recorder]:
    from ettr.bootstrap.hooks import AutoHooks

    rec = Recorder(open_ledger(run_dir), run_dir=run_dir, attempt=attempt, rank=rank)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        yield rec
    finally:
        hooks.uninstall()
        rec.close()


def _train(steps: int) -> Any:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


def _save_renamed(obj: Any, path: Path) -> None:
    torch.save(obj, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def _resumed(run_dir: Path, attempt: int, load: Path) -> list[tuple[int | None, str | None]]:
    """Attempt `attempt` loads `load` before its first step, then trains one step: its RESUMED events."""
    with _hooked(run_dir, attempt=attempt):
        torch.load(load)
        _train(1)
    events = open_ledger(run_dir).read()
    return [
        (e.step, (e.data or {}).get("unknown"))
        for e in events
        if e.kind is EventKind.RESUMED and e.attempt == attempt
    ]


def test_the_last_writer_of_a_shared_path_is_found_and_an_unseen_writer_makes_it_unknown(
    tmp_path: Path,
) -> None:
    run_dir, shared = tmp_path / "run", tmp_path / "shared.pt"
    with _hooked(run_dir, attempt=0, rank=0):
        _train(2)
        _save_renamed({"w": torch.zeros(2)}, shared)
    with _hooked(run_dir, attempt=0, rank=1):  # rank 1 saves the same path later, at step 4
        _train(4)
        _save_renamed({"w": torch.ones(2)}, shared)
    assert _resumed(run_dir, 1, shared) == [(4, None)]
    torch.save({"w": torch.full((2,), 7.0)}, shared)  # a writer ettr did not see (no hooks installed)
    [(step, why)] = _resumed(run_dir, 2, shared)
    assert step is None and "none of the saves recorded" in why and "steps 2, 4" in why
    torch.save({"w": torch.full((2,), 8.0), "global_step": 9}, shared)  # it names its own step: that one
    assert _resumed(run_dir, 3, shared) == [(9, None)]


def test_a_save_interrupted_before_its_rename_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    with _hooked(run_dir, attempt=0):
        _train(2)
        _save_renamed({"w": torch.zeros(2)}, ckpt)
        _train(2)
        torch.save({"w": torch.ones(2)}, f"{ckpt}.tmp")  # step 4's save, the crash came before its rename
    assert _resumed(run_dir, 1, ckpt) == [(2, None)]


def test_a_file_replaced_by_the_user_is_unknown_and_the_report_says_so(tmp_path: Path) -> None:
    run_dir, ckpt, backup = tmp_path / "run", tmp_path / "ckpt.pt", tmp_path / "backup.pt"
    with _hooked(run_dir, attempt=0):
        _train(2)
        _save_renamed({"w": torch.zeros(2)}, ckpt)
    torch.save({"w": torch.ones(2)}, backup)
    shutil.copyfile(backup, ckpt)  # the user put another checkpoint in its place
    [(step, why)] = _resumed(run_dir, 1, ckpt)
    assert step is None and "none of the saves recorded" in why
    from ettr.accounting import compute
    from ettr.report.html import render_html
    from ettr.report.json import to_dict
    from ettr.report.text import render

    events = open_ledger(run_dir).read()
    report = compute(events, max(e.ts for e in events))
    second = to_dict(report)["attempts"][1]
    assert second["resumed_from_step"] is None and "none of the saves" in second["resumed_step_unknown"]
    assert "attempt 1 resumed from an unknown step" in render(report)
    page = render_html([report])
    assert "<td>unknown</td><td>unknown</td>" in page and "resumed from an unknown step" in page


def test_a_load_while_the_books_cannot_be_read_is_a_resume_of_unknown_step_never_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ledger server away when a restart loads its checkpoint (found by test_ledger_outage): the load was
    # once taken for pretrained weights, and the attempt's steps counted from 1.
    import ettr.ledger
    from ettr.ledger import LedgerError

    run_dir, ckpt, plain = tmp_path / "run", tmp_path / "ckpt.pt", tmp_path / "plain.pt"
    with _hooked(run_dir, attempt=0):
        _train(2)
        _save_renamed({"w": torch.zeros(2), "step": 2}, ckpt)
        _save_renamed({"w": torch.zeros(2)}, plain)

    def away(run_dir: Any) -> list[Event]:
        raise LedgerError("the ledger server is unreachable")

    monkeypatch.setattr(ettr.ledger, "read_run_events", away)
    assert _resumed(run_dir, 1, ckpt) == [(2, None)]  # the object's own step
    [(step, why)] = _resumed(run_dir, 2, plain)
    assert step is None and "could not be read" in why and "unreachable" in why


def test_a_checkpoint_torn_mid_write_is_named_in_the_load_failure(tmp_path: Path) -> None:
    """nanoGPT saves with torch.save straight to out/ckpt.pt; a rank killed mid-save (torchrun or ettr stopping
    the rest after a peer's exception) leaves a truncated file, and every restart died of a bare `EOFError`
    (`rank 0 failed: EOFError`, exit 3) with nothing naming the file. The load's exception now says which
    checkpoint is torn, in its traceback (a note) and in the rank's FAILURE."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    with _hooked(run_dir, attempt=0):
        _train(2)
        torch.save({"w": torch.zeros(2)}, ckpt)
    ckpt.write_bytes(b"")  # the next save's open truncated it, then its process was killed
    with _hooked(run_dir, attempt=1) as rec, pytest.raises(Exception) as raised:
        try:
            torch.load(ckpt)
        except Exception as exc:
            rec.failure(exc)  # what the bootstrap's excepthook records
            raise
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and str(ckpt) in notes[0] and "0 bytes" in notes[0] and "steps 2" in notes[0]
    assert "cut off mid-write" in notes[0]
    events = open_ledger(run_dir).read()
    [failure] = [e for e in events if e.kind is EventKind.FAILURE]
    assert failure.data["exception"] == type(raised.value).__name__
    text, [note] = split_failure_message(failure.data["message"])
    assert (
        str(ckpt) in note
        and "cut off mid-write" in note
        and note.startswith("[ettr: ")
        and "ettr" not in text
    )
    assert any(e.kind is EventKind.MARK and e.data.get("name") == "checkpoint_load_failed" for e in events)


def test_a_failed_load_of_an_intact_or_foreign_file_gets_no_note(tmp_path: Path) -> None:
    run_dir, ckpt, other = tmp_path / "run", tmp_path / "ckpt.pt", tmp_path / "other.pt"
    with _hooked(run_dir, attempt=0):
        _train(2)
        torch.save({"w": torch.zeros(2)}, ckpt)
    other.write_bytes(b"")  # a file no save of this job wrote
    with _hooked(run_dir, attempt=1):
        for path, kwargs in ((ckpt, {"map_location": "no-such-device"}), (other, {})):
            with pytest.raises(Exception) as raised:
                torch.load(path, **kwargs)
            assert not getattr(raised.value, "__notes__", None)


def test_a_file_an_earlier_process_of_the_same_attempt_saved_is_that_attempts_own(tmp_path: Path) -> None:
    """pytorch/examples' time_sequence_prediction run as its README says, behind a wrapper (`python
    generate_sine_wave.py; python train.py`): each attempt writes traindata.pt again, then loads it. The restart
    took the file for one rewritten behind ettr's back: a resume of unknown step, and its failed load
    (torch.load's weights_only refusing numpy) was told "a save cut off mid-write? ... put the last good one
    back". A file an earlier process of the same attempt saved is the attempt's own: neither."""
    run_dir, data = tmp_path / "run", tmp_path / "traindata.pt"
    for attempt in (0, 1):
        with _hooked(run_dir, attempt=attempt):  # the generating process
            torch.save({"x": torch.rand(4)}, data)
        with _hooked(run_dir, attempt=attempt):  # the training process
            torch.load(data)
            _train(2)
    events = open_ledger(run_dir).read()
    assert not [e for e in events if e.kind is EventKind.RESUMED and (e.data or {}).get("unknown")]
    with _hooked(run_dir, attempt=2):
        torch.save({"x": torch.rand(4)}, data)
    with _hooked(run_dir, attempt=2), pytest.raises(Exception) as raised:
        torch.load(data, map_location="no-such-device")
    assert not getattr(raised.value, "__notes__", None)


class _NoRoom:
    def __reduce__(self) -> Any:
        raise OSError(28, "No space left on device")  # what a write to a full disk raises (errno.ENOSPC)


def test_a_save_that_fails_on_a_full_file_system_says_so(tmp_path: Path) -> None:
    """Field trial: pytorch/examples' DDP tutorial saving its snapshot to a full tmpfs died of torch's
    `RuntimeError: basic_ios::clear: iostream error`, booked `user (exception)` with nothing about the disk."""
    from types import SimpleNamespace

    from ettr.bootstrap.checkpoint_hooks import full_disk_note

    ckpt = tmp_path / "snap.pt"
    error = RuntimeError("basic_ios::clear: iostream error")
    full = SimpleNamespace(f_bavail=0, f_frsize=4096, f_blocks=256)
    roomy = SimpleNamespace(f_bavail=10**6, f_frsize=4096, f_blocks=10**7)
    note = full_disk_note(str(ckpt), error, lambda _: full)
    assert note is not None and f"the file system of {tmp_path} is full (0 of 1048576 bytes free)" in note
    assert full_disk_note(str(ckpt), error, lambda _: roomy) is None  # room left: another cause
    assert full_disk_note("s3://bucket/snap.pt", error, lambda _: full) is None
    # Through the save hook: an ENOSPC on the way (however much room statvfs shows afterwards) is noted.
    run_dir = tmp_path / "run"
    with _hooked(run_dir, attempt=0) as rec, pytest.raises(OSError) as raised:
        _train(1)
        try:
            torch.save({"x": _NoRoom()}, ckpt)
        except OSError as exc:
            rec.failure(exc)
            raise
    [note] = getattr(raised.value, "__notes__", [])
    assert "is full" in note and str(ckpt) in note
    [failure] = [e for e in open_ledger(run_dir).read() if e.kind is EventKind.FAILURE]
    assert "is full" in split_failure_message(failure.data["message"])[1][0]
