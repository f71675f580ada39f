"""Inside the root stays inside (issue 25 item 4): retention, restore, leases, quarantine and saves never
follow a symlink out of the checkpoint root; a checkpoint names the job and root that wrote it, and one
copied in from another root is not resumed unless asked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint.base import MANIFEST_NAME, step_dir_name
from ettr.checkpoint.commit import apply_retention, lease, list_checkpoints, verify
from ettr.checkpoint.storage import LocalStorage, SymlinkRefused
from ettr.ledger import MemoryLedger
from ettr.testing import forge
from ettr.testing.recorder import SyncRecorder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _manager(root: Path, rec: SyncRecorder, **kwargs) -> CheckpointManager:
    kwargs.setdefault("keep_last", 10)
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=1), **kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return CheckpointManager(config, state, recorder=rec)


def _save(root: Path, steps: list[int], **kwargs) -> None:
    with _manager(root, SyncRecorder(MemoryLedger()), **kwargs) as manager:
        for step in steps:
            assert manager.save(step, wait=True)


def _restore(root: Path, **kwargs) -> tuple[int | None, dict[str, list[dict]]]:
    rec = SyncRecorder(MemoryLedger())
    with _manager(root, rec, **kwargs) as manager:
        step = manager.restore()
    marks: dict[str, list[dict]] = {}
    for event in rec.events():
        if event.data and "name" in event.data:
            marks.setdefault(event.data["name"], []).append(event.data)
    return step, marks


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def other_job(tmp_path) -> Path:
    """Another job's checkpoint root, with one committed checkpoint (step 1)."""
    root = tmp_path / "other-job"
    _save(root, [1])
    return root


def test_retention_never_deletes_through_a_symlinked_step(tmp_path, other_job):
    # The probe: a symlinked step_* made retention delete another job's manifest.
    root = tmp_path / "mine"
    root.mkdir()
    victim = other_job / step_dir_name(1)
    before = _snapshot(victim)
    (root / step_dir_name(1)).symlink_to(victim, target_is_directory=True)
    _save(root, [2, 3, 4], keep_last=1)  # retention runs after every commit
    assert _snapshot(victim) == before
    assert verify(LocalStorage(other_job), step_dir_name(1)).step == 1
    storage = LocalStorage(root)
    assert [c.step for c in list_checkpoints(storage)] == [4]  # the link is never listed
    assert apply_retention(storage, keep_last=1) == []


def test_restore_never_sees_a_symlinked_step(tmp_path, other_job):
    root = tmp_path / "mine"
    _save(root, [2])
    (root / step_dir_name(9)).symlink_to(other_job / step_dir_name(1), target_is_directory=True)
    step, marks = _restore(root)
    assert step == 2 and "checkpoint_skipped" not in marks
    assert (other_job / step_dir_name(1) / MANIFEST_NAME).exists()


def test_a_symlinked_file_inside_a_checkpoint_is_not_read(tmp_path):
    root = tmp_path / "mine"
    _save(root, [1, 2])
    directory = root / step_dir_name(2)
    shard = next(p for p in directory.iterdir() if p.suffix == ".distcp")
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(shard, outside)  # the same bytes: followed, the checkpoint would verify
    shard.unlink()
    shard.symlink_to(outside)
    step, marks = _restore(root)
    assert step == 1
    assert "missing" in marks["checkpoint_skipped"][0]["reason"]
    assert outside.exists()


def test_a_save_never_writes_through_a_symlink_planted_where_it_writes(tmp_path):
    root = tmp_path / "mine"
    _save(root, [1])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (root / step_dir_name(2)).symlink_to(victim, target_is_directory=True)
    _save(root, [2])
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]
    assert not (root / step_dir_name(2)).is_symlink()
    assert verify(LocalStorage(root), step_dir_name(2)).step == 2


def test_leases_and_reads_refuse_symlinks(tmp_path, other_job):
    root = tmp_path / "mine"
    root.mkdir()
    link = root / step_dir_name(5)
    link.symlink_to(other_job / step_dir_name(1), target_is_directory=True)
    storage = LocalStorage(root)
    before = _snapshot(other_job / step_dir_name(1))
    with lease(storage, step_dir_name(5)):  # cannot be taken: never written into the target
        assert _snapshot(other_job / step_dir_name(1)) == before
    with pytest.raises(SymlinkRefused):
        storage.read_bytes(f"{step_dir_name(5)}/{MANIFEST_NAME}")
    assert storage.list_dir(step_dir_name(5)) == {}
    storage.remove_tree(step_dir_name(5))  # removes the link, not what it points at
    assert not link.exists() and not link.is_symlink()
    assert _snapshot(other_job / step_dir_name(1)) == before


def test_a_metadata_item_pointing_outside_its_checkpoint_is_refused(tmp_path):
    root = tmp_path / "mine"
    _save(root, [1, 2])
    other = tmp_path / "other.distcp"
    shard = next(p for p in (root / step_dir_name(2)).iterdir() if p.suffix == ".distcp")
    shutil.copyfile(shard, other)
    forge.point_item_outside(
        root / step_dir_name(2), "model.", os.path.relpath(other, root / step_dir_name(2))
    )
    step, marks = _restore(root, allow_unsigned=True)  # past the signature check: the metadata check decides
    assert step == 1 and "outside its checkpoint" in marks["checkpoint_skipped"][0]["reason"]


def test_a_checkpoint_names_its_job_and_root_and_a_foreign_one_is_refused_until_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("ETTR_CHECKPOINT_RESUME_FOREIGN", raising=False)
    first = tmp_path / "first-job"
    _save(first, [3], job_id="job-A")
    body = json.loads((first / step_dir_name(3) / MANIFEST_NAME).read_text())
    assert body["job_id"] == "job-A" and body["root"] == os.path.realpath(first)

    second = tmp_path / "second-job"
    second.mkdir()
    shutil.copytree(first / step_dir_name(3), second / step_dir_name(3))  # copied in by hand
    step, marks = _restore(second, job_id="job-B")
    assert step is None
    reason = marks["checkpoint_refused"][0]["reason"]
    assert "job-A" in reason and os.path.realpath(first) in reason and "RESUME_FOREIGN" in reason
    assert (second / step_dir_name(3) / MANIFEST_NAME).exists()  # left where it is
    monkeypatch.setenv("ETTR_CHECKPOINT_RESUME_FOREIGN", "1")
    assert _restore(second, job_id="job-B")[0] == 3
    monkeypatch.delenv("ETTR_CHECKPOINT_RESUME_FOREIGN")
    assert _restore(second, job_id="job-B", resume_foreign=True)[0] == 3
    # The same root under another job id (a chained job, a rerun) resumes as usual.
    assert _restore(first, job_id="job-C")[0] == 3


def test_a_root_reached_through_a_symlink_is_the_same_root(tmp_path):
    real = tmp_path / "real"
    _save(real, [1])
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    assert _restore(alias)[0] == 1  # the root itself may be a link: the user chose it


def test_a_refused_checkpoint_outlives_the_saves_and_retention_of_the_run_that_refused_it(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("ETTR_CHECKPOINT_RESUME_FOREIGN", raising=False)
    first = tmp_path / "first-job"
    _save(first, [3, 4], job_id="job-A")
    copied = tmp_path / "copied"
    shutil.copytree(first, copied)  # "start from an old run's checkpoints": copied in, then refused
    before = {n: _snapshot(copied / step_dir_name(n)) for n in (3, 4)}
    rec = SyncRecorder(MemoryLedger())
    with _manager(copied, rec, job_id="job-B", keep_last=1) as manager:
        assert manager.restore() is None  # refused: another job's
        for step in range(1, 7):  # writes steps 3 and 4 itself; retention keeps the newest one
            assert manager.save(step, wait=True)
    names = sorted(p.name for p in copied.iterdir() if p.name.startswith("step_"))
    assert step_dir_name(6) in names and step_dir_name(1) not in names  # retention ran
    for n in (3, 4):  # job-A's checkpoints moved aside, whole, when job-B saved the same step
        aside = [p for p in copied.iterdir() if p.name.startswith(f"{step_dir_name(n)}.replaced-")]
        assert len(aside) == 1 and _snapshot(aside[0]) == before[n]


def test_a_refused_checkpoint_newer_than_the_run_is_never_deleted_by_its_retention(tmp_path, monkeypatch):
    monkeypatch.delenv("ETTR_CHECKPOINT_RESUME_FOREIGN", raising=False)
    first = tmp_path / "first-job"
    _save(first, [50, 60], job_id="job-A")
    before = _snapshot(first / step_dir_name(50))
    copied = tmp_path / "copied"
    shutil.copytree(first, copied)
    rec = SyncRecorder(MemoryLedger())
    with _manager(copied, rec, job_id="job-B", keep_last=1) as manager:
        assert manager.restore() is None
        for step in range(1, 4):
            assert manager.save(step, wait=True)
    assert _snapshot(copied / step_dir_name(50)) == before  # older than job-A's newest: kept all the same
    assert (copied / step_dir_name(60) / MANIFEST_NAME).exists()


def _nest(directory: Path, depth: int) -> None:
    (directory / Path(*["d"] * depth)).mkdir(parents=True)


def test_a_deep_tree_is_deleted_without_recursion(tmp_path):
    # shutil.rmtree recurses once per level: a folder nested 1,500 deep planted as an incomplete step_* made
    # every attempt's restore raise RecursionError (the job ended with status 3, never training). 120 levels
    # here, under a recursion limit that leaves the deletion 60 frames (a tree 1,500 deep would outlast
    # pytest's own clean-up, which recurses as rmtree does).
    import inspect
    import sys

    storage = LocalStorage(tmp_path / "root")
    planted = tmp_path / "root" / step_dir_name(9)
    _nest(planted, 120)
    (planted / "d" / "link").symlink_to(tmp_path, target_is_directory=True)  # removed, never followed
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 60)
    try:
        storage.remove_tree(step_dir_name(9))
    finally:
        sys.setrecursionlimit(limit)
    assert not planted.exists() and (tmp_path / "root").is_dir()


def test_a_tree_too_deep_to_delete_never_stops_restore_retention_or_a_save(tmp_path):
    # Deeper than ettr deletes (`ettr.untrusted.MAX_REMOVE_DEPTH`): left in place (or moved aside), while the
    # job restores, keeps its retention and saves over the name.
    from ettr.untrusted import MAX_REMOVE_DEPTH

    root = tmp_path / "root"
    _save(root, [2])
    for step in (1, 3, 9):  # older than the newest (retention), the next save's name, newer (restore)
        _nest(root / step_dir_name(step), MAX_REMOVE_DEPTH + 20)
    step, _marks = _restore(root)
    assert step == 2
    _save(root, [3, 4], keep_last=1)
    assert [c.step for c in list_checkpoints(LocalStorage(root)) if c.has_manifest] == [4]
    names = sorted(p.name for p in root.iterdir())
    assert step_dir_name(3) not in names and any(n.startswith(f"{step_dir_name(3)}.replaced-") for n in names)
    assert step_dir_name(1) in names and step_dir_name(9) in names  # left in place, never loaded
