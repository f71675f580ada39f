"""The bootstrap's checkpoint hooks on the patterns frameworks use: saves through file objects and in-memory
buffers written to a file (Lightning), one checkpoint of several files (HF), safetensors, and a resume whose
step the hooks cannot know (reported as unknown, never as a start from scratch)."""

from __future__ import annotations

import builtins
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ettr.accounting import compute
from ettr.bootstrap.checkpoint_targets import holds_training_state, is_binary_write, path_of, step_in
from ettr.events import Event, EventKind, Outcome, Phase
from ettr.ledger import open_ledger
from ettr.recorder import Recorder

torch = pytest.importorskip("torch")


@pytest.fixture
def hooked(tmp_path: Path) -> Iterator[tuple[Any, Recorder, Any]]:
    """Attempt 1 of a job whose attempt 0 (from a minute ago) committed `earlier.pt` at step 5."""
    from ettr.bootstrap.hooks import AutoHooks

    ledger = open_ledger(tmp_path / "run")
    earlier = tmp_path / "earlier.pt"
    torch.save({"w": torch.zeros(2)}, earlier)
    # A minute ago, not at t=1.0: the ledger skips a row decades from the job's other rows.
    ledger.append(
        [Event(EventKind.CHECKPOINT_COMMIT, time.time() - 60, 0, 0, step=5, data={"path": str(earlier)})]
    )
    rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=1, rank=0)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        yield hooks, rec, ledger
    finally:
        hooks.uninstall()
        rec.close()


def _events(rec: Recorder, ledger: Any, *kinds: EventKind) -> list[Event]:
    rec.flush()
    return [e for e in ledger.read() if e.rank >= 0 and e.attempt == rec.attempt and e.kind in kinds]


def _step(optimizer: Any, model: Any) -> None:
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()


def test_target_helpers() -> None:
    assert path_of("a/b.pt") == os.path.realpath("a/b.pt")
    assert path_of(io.BytesIO()) is None and path_of(3) is None
    with open(os.devnull, "wb") as f:
        assert path_of(f) == os.path.realpath(os.devnull)
    assert is_binary_write("wb") and is_binary_write("r+b") and not is_binary_write("rb")
    assert not is_binary_write("w")
    assert step_in({"global_step": 30, "step": 2}) == ("global_step", 30)
    assert step_in({"step": True}) is None and step_in([1]) is None and step_in({"epoch": 3}) is None


def test_a_buffer_written_to_a_file_and_renamed_is_one_checkpoint(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.load(tmp_path / "earlier.pt")  # resumes at 5
    _step(optimizer, model)  # step 6
    # Lightning's _atomic_save: serialize to memory, write the bytes to a temporary file, move it into place.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    final = tmp_path / "epoch=0-step=6.ckpt"
    with open(str(final) + ".part", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(str(final) + ".part", final)
    torch.save({"not": "a checkpoint"}, io.BytesIO())  # never written anywhere
    _step(optimizer, model)  # step 7 settles both
    commits = _events(rec, ledger, EventKind.CHECKPOINT_COMMIT)
    assert [(c.step, Path(c.data["path"]).name) for c in commits] == [(6, final.name)]
    spans = [e for e in _events(rec, ledger, EventKind.PHASE_END) if e.phase is Phase.CHECKPOINT_BLOCKING]
    assert len(spans) == 1 and spans[0].ts >= spans[0].value and spans[0].step == 6
    assert not hasattr(builtins.open, "__wrapped__") and builtins.open is io.open  # given back


def test_file_objects_and_several_files_of_one_checkpoint(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with open(tmp_path / "earlier.pt", "rb") as f:  # an open file: matched by its name
        torch.load(f)
    _step(optimizer, model)
    folder = tmp_path / "checkpoint-6"
    folder.mkdir()
    with open(folder / "model.pt", "wb") as f:
        torch.save(model.state_dict(), f)
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    commits = _events(rec, ledger, EventKind.CHECKPOINT_COMMIT)
    # the bootstrap's own marks (imports_done) are not checkpoint files
    marks = [m for m in _events(rec, ledger, EventKind.MARK) if m.data.get("name") == "checkpoint_file"]
    assert [e.step for e in _events(rec, ledger, EventKind.RESUMED)] == [5]
    assert [(c.step, Path(c.data["path"]).name) for c in commits] == [(6, "model.pt")]
    assert [(m.data["step"], Path(m.data["path"]).name) for m in marks] == [(6, "optimizer.pt")]
    blocking = [e for e in _events(rec, ledger, EventKind.PHASE_END) if e.phase is Phase.CHECKPOINT_BLOCKING]
    assert len(blocking) == 2  # each file's time is blocking time


def test_a_later_attempt_loading_any_file_of_a_checkpoint_resumes_from_its_step(tmp_path: Path) -> None:
    from ettr.bootstrap.hooks import AutoHooks

    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")  # what HF's optimizer.pt holds
    ledger = open_ledger(tmp_path / "run")
    ledger.append(
        [
            Event(EventKind.CHECKPOINT_COMMIT, time.time() - 60, 0, 0, step=10, data={"path": str(folder / "model.pt")}),
            Event(EventKind.MARK, time.time() - 59, 0, 0, data={"name": "checkpoint_file", "step": 10, "path": str(folder / "optimizer.pt")}),
        ]
    )  # fmt: skip
    rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=1)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        torch.load(folder / "optimizer.pt")
        rec.flush()
        assert [e.step for e in ledger.read() if e.kind is EventKind.RESUMED] == [10]
    finally:
        hooks.uninstall()
        rec.close()


def test_safetensors_files_are_checkpoint_files(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hooks, rec, ledger = hooked
    hooks.on_safetensors(safetensors_torch)
    safetensors_torch.save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(safetensors_torch.load_file(str(tmp_path / "model.safetensors"))["w"], torch.ones(2))
    commits = _events(rec, ledger, EventKind.CHECKPOINT_COMMIT)
    assert [Path(c.data["path"]).name for c in commits] == ["model.safetensors"]
    restores = [e for e in _events(rec, ledger, EventKind.PHASE_END) if e.phase is Phase.RESTORE]
    assert len(restores) == 1


def test_what_holds_training_state_and_what_is_data() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = [
        model,
        model.state_dict(),  # weight, bias
        torch.nn.Sequential(model).state_dict(),  # 0.weight: a parameter path
        optimizer,
        optimizer.state_dict(),
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 5},  # nanoGPT's
        {"model": {"w": torch.zeros(2)}},  # any tensors under a model key
        {"w": torch.zeros(2)},  # a tensor under a name that could be a parameter's: counted as state
        [{"state_dict": model.state_dict()}],
        torch.nn.Parameter(torch.zeros(2)),
    ]
    data = [
        torch.zeros(3),
        (torch.zeros(3), torch.zeros(3)),
        [torch.zeros(2)] * 1000,
        {"x": torch.zeros(2), "y": torch.zeros(2)},
        {"input_ids": torch.zeros(2), "attention_mask": torch.zeros(2), "labels": torch.zeros(2)},
        torch.utils.data.TensorDataset(torch.zeros(3), torch.zeros(3)),
        {"vocab": {"a": 1}, "w": 1},  # no tensor at all
    ]
    assert [holds_training_state(x) for x in state] == [True] * len(state)
    assert [holds_training_state(x) for x in data] == [False] * len(data)


def test_a_load_of_data_is_start_up_work_never_a_restore_or_a_resume(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked  # attempt 1; attempt 0 committed earlier.pt at step 5
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    unseen_save = torch.save.__ettr_original__  # written during the job by something the hooks did not see
    tokens = tmp_path / "tokens.pt"
    unseen_save(torch.arange(100), tokens)
    samples = tmp_path / "samples.pt"
    unseen_save({"x": torch.zeros(8, 4), "y": torch.zeros(8)}, samples)
    pretrained = tmp_path / "pretrained.pt"
    unseen_save(model.state_dict(), pretrained)
    os.utime(pretrained, (0.5, 0.5))  # older than the job: weights, not a resume
    torch.load(tokens)
    torch.load(samples)
    torch.load(pretrained)
    torch.load(tmp_path / "earlier.pt")  # the job's own checkpoint: the resume
    _step(optimizer, model)
    restores = [e.data["path"] for e in _events(rec, ledger, EventKind.PHASE_END) if e.phase is Phase.RESTORE]
    assert [Path(p).name for p in restores] == ["pretrained.pt", "earlier.pt"]
    assert [(e.step, e.data) for e in _events(rec, ledger, EventKind.RESUMED)] == [(5, None)]
    assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [6]


def test_a_data_file_the_job_saved_never_hides_the_real_resume(tmp_path: Path) -> None:
    from ettr.bootstrap.hooks import AutoHooks

    cache, ckpt = tmp_path / "tokens.pt", tmp_path / "ckpt.pt"
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = open_ledger(tmp_path / "run")
    for attempt in (0, 1):
        rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=attempt, rank=0)
        hooks = AutoHooks(rec)
        hooks.on_torch(torch)
        try:
            if attempt == 0:
                torch.save(
                    torch.arange(10), cache
                )  # a tokenization cache, saved at step 0 (taken for a commit)
                for _ in range(3):
                    _step(optimizer, model)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
            else:
                torch.load(cache)  # matches attempt 0's save of step 0, but holds only data
                torch.load(ckpt)  # the checkpoint of step 3: the resume
                _step(optimizer, model)
                assert [e.step for e in _events(rec, ledger, EventKind.RESUMED)] == [3]
                assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [4]
        finally:
            hooks.uninstall()
            rec.close()


def test_a_survivor_restarted_in_place_resumes_from_the_checkpoint_it_committed_itself(
    tmp_path: Path,
) -> None:
    # pytorch/examples' DDP tutorial with `ettr.resilient`, rank 1 SIGKILLed: the surviving rank 0 went on in
    # place into attempt 1 and loaded the snapshot it had saved in attempt 0. Its hooks had read the earlier
    # attempts' saves once, at attempt 0 (none): the load read as a resume of unknown step and its steps were
    # numbered from 1 again, where its replacement's load of the same file was placed at the snapshot's step.
    from ettr.bootstrap.hooks import AutoHooks

    ckpt = tmp_path / "snapshot.pt"
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = open_ledger(tmp_path / "run")
    rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=0, rank=0)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        torch.save({"model": model.state_dict()}, ckpt)  # a snapshot an earlier job left (the tutorial's own)
        os.utime(ckpt, (0.5, 0.5))
        torch.load(ckpt)  # attempt 0 starts from it: not a resume (older than the job)
        for _ in range(3):
            _step(optimizer, model)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
        for _ in range(2):
            _step(optimizer, model)  # steps 4 and 5, lost with the peer
        rec.set_attempt(1)  # `ettr.bootstrap.start.continue_attempt`, at the new generation
        hooks.new_generation()
        torch.load(ckpt)
        _step(optimizer, model)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)
        assert [(e.step, e.data) for e in _events(rec, ledger, EventKind.RESUMED)] == [(3, None)]
        assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [4]
        assert [e.step for e in _events(rec, ledger, EventKind.CHECKPOINT_COMMIT)] == [4]
    finally:
        hooks.uninstall()
        rec.close()


def test_an_unplaceable_resume_is_unknown_or_read_from_the_checkpoint(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pretrained = tmp_path / "pretrained.pt"
    torch.save({"w": torch.zeros(2)}, pretrained)
    os.utime(pretrained, (0.5, 0.5))  # older than the job (which began a minute ago): not a resume
    torch.load(pretrained)
    unseen = tmp_path / "unseen.pt"
    torch.save({"w": torch.ones(2)}, unseen)  # written during the job by something the hooks did not see
    torch.load(unseen)
    _step(optimizer, model)
    resumed = _events(rec, ledger, EventKind.RESUMED)
    assert [(e.step, "no earlier attempt was seen saving it" in e.data["unknown"]) for e in resumed] == [
        (None, True)
    ]
    assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [1]  # counted from an unknown base


def test_a_resume_step_named_in_the_loaded_checkpoint_is_used(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = io.BytesIO()
    torch.save({"global_step": 30, "state_dict": model.state_dict()}, buffer)
    buffer.seek(0)
    torch.load(buffer)  # loaded from memory: no path to match, but it names its step
    _step(optimizer, model)
    assert [e.step for e in _events(rec, ledger, EventKind.RESUMED)] == [30]
    assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [31]


def test_a_save_right_after_a_resume_before_the_first_step_is_at_the_resumed_step(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    """nanoGPT under a multi-node torchrun: the rank that saves changed between attempts, so the loaded file
    matches none of this run's commits and the step comes from its `iter_num`; the script evaluates and saves
    at that iteration before its first step. That save is the resumed step's, not step 0's."""
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = tmp_path / "ckpt.pt"
    buffer = io.BytesIO()
    torch.save({"iter_num": 100, "model": model.state_dict()}, buffer)
    fd = os.open(ckpt, os.O_WRONLY | os.O_CREAT)  # written by a rank this run never saw saving
    os.write(fd, buffer.getvalue())
    os.close(fd)
    torch.load(ckpt)
    torch.save({"iter_num": 100, "model": model.state_dict()}, ckpt)  # the save at the resumed iteration
    _step(optimizer, model)
    commits = [e.step for e in _events(rec, ledger, EventKind.CHECKPOINT_COMMIT)]
    assert commits == [100]
    assert [e.step for e in _events(rec, ledger, EventKind.RESUMED)] == [100]
    assert [e.step for e in _events(rec, ledger, EventKind.STEP)] == [101]


def test_the_report_says_unknown_and_estimates_the_lost_steps() -> None:
    def attempt(index: int, start: float, end: float, outcome: str, steps: range) -> list[Event]:
        events = [
            Event(EventKind.ATTEMPT_START, start, index, -1),
            Event(EventKind.PROCESS_START, start, index, 0),
            *(Event(EventKind.STEP, start + 1 + i, index, 0, step=s) for i, s in enumerate(steps)),
            Event(EventKind.ATTEMPT_END, end, index, -1, data={"outcome": outcome, "exit_code": 0 if outcome == "completed" else 1}),
        ]  # fmt: skip
        return events

    events = [
        Event(EventKind.SUPERVISOR_START, 0.0, 0, -1),
        *attempt(0, 0.0, 20.0, "failed", range(1, 15)),
        Event(EventKind.CHECKPOINT_COMMIT, 11.5, 0, 0, step=10, data={"path": "/c/10"}),
        *attempt(1, 21.0, 40.0, "completed", range(1, 11)),
        Event(
            EventKind.RESUMED, 21.5, 1, 0, data={"unknown": "/c/x was loaded but no earlier attempt saved it"}
        ),
        Event(EventKind.JOB_END, 40.0, 0, -1, data={"exit_status": 0}),
    ]
    report = compute(events, 40.0)
    first, second = report.attempts
    assert second.resumed_from_step is None and second.last_step is None
    assert "no earlier attempt" in (second.resumed_step_unknown or "")
    assert first.outcome is Outcome.FAILED and first.lost_steps == 4 and first.lost_steps_estimated
    from ettr.report.json import to_dict
    from ettr.report.text import render

    attempts = to_dict(report)["attempts"]
    assert attempts[1]["resumed_step_unknown"] and attempts[1]["resumed_from_step"] is None
    assert attempts[0]["lost_steps_estimated"] is True
    assert "resumed from an unknown step" in render(report)
