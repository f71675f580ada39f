"""Checkpoint hooks of the bootstrap: saves and loads through torch.save/load and torch.distributed.checkpoint.

Saves: the call is a CHECKPOINT_BLOCKING span at the current global step; once it has returned (not before),
CHECKPOINT_COMMIT(step, path), so a resume point is only claimed for a file that was written; the commit is
written to the books before the save returns (`COMMIT_FLUSH_S`), so a process that ends right after it (a
SIGTERM handler that saves, then re-raises the signal with SIG_DFL) keeps it. A save that
is renamed into place (`torch.save(tmp)` then `os.replace(tmp, final)`) commits the final path at the
rename. `dcp.async_save` blocks for the staging only: its call is the blocking span, and the commit (with
a CHECKPOINT_PERSIST span for the overlapped upload) comes when its future completes.

Loads: a load of a file that an earlier attempt's save left (read from the ledger at the first load; tied to
that save by the identity each commit records, see `checkpoint_identity`) is a RESTORE span and
RESUMED(step) — the attempt's global steps then count on from that step. A file of a path several saves
wrote that cannot be tied to saves of one step is a resume of unknown step (below), never another save's.
Other loads before the first step of an object that holds a model's or an optimizer's state
(`checkpoint_targets.holds_training_state`: pretrained weights) are RESTORE spans too; a load of data
(tensors, a dataset: no such state) that no save of this job left is start-up work, recorded as nothing (its
time is `init`) and never a resume; later unmatched loads are the script's business and not recorded.

Targets: a path, or an open file (its `name`, or an fsspec file's `path`), is a checkpoint file. A save to an
in-memory buffer is a checkpoint only once the buffer is written to a file (Lightning's pattern: `torch.save`
to a BytesIO, then the bytes to a file opened for writing, maybe renamed into place); until the next optimizer
step the first binary file this thread opens for writing is taken as that target, and the save is committed
at that step (or at exit) as the file's final name, its blocking span ending when the file was last written.
A buffer never written to a file is serialization, not a checkpoint. safetensors' `save_file`/`load_file`
are checkpoint files too.

One checkpoint, several files: the first file saved at a global step commits that step; further files of the
same step (HF's optimizer.pt, scheduler.pt, ...; Lightning's `last.ckpt`) are `checkpoint_file` marks, each
with its own blocking span, so a later attempt loading any of them is matched and the checkpoint counts once.

Unknown resume: in a later attempt, a load before the first step that matches no earlier file, of a file
written during this job (not pretrained weights, which predate it) or of an in-memory buffer, is a resume
whose step the hooks did not see. The step is taken from the loaded object's own `global_step` (or `step`,
`iteration`, `iter_num`) when it has one; else RESUMED(None) carries `data.unknown`, the reason, and the
report says the resumed step is unknown instead of claiming a start from scratch.

Calls made by ettr's own modules (the checkpoint manager records itself) and nested calls (dcp writing
through torch.save) are not recorded twice, but a save the script itself makes inside another one (its
SIGTERM handler run again by a second SIGTERM mid-save, which then exits through the first) is a save; nor are saves and loads inside a phase that user code or a
framework callback records itself. `--inject KIND@checkpoint` fires inside the save, before the data is
written, so that checkpoint never commits.
"""

from __future__ import annotations

import atexit
import builtins
import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr import inject
from ettr.bootstrap.checkpoint_identity import (
    IDENTITY_KEY,
    Attribution,
    SaveIndex,
    file_identity,
    identities_saved_in,
)
from ettr.bootstrap.checkpoint_targets import (
    BufferSave,
    holds_training_state,
    is_binary_write,
    is_buffer,
    path_of,
    step_in,
)
from ettr.bootstrap.hooks import Guard, Patcher, StepCounter, called_from_ettr
from ettr.bootstrap.save_signals import held_stop_signals
from ettr.bootstrap.save_window import SaveWindow, is_library_frame
from ettr.constants import CHECKPOINT_LOAD_FAILED_MARK, COMMIT_FLUSH_S
from ettr.events import FAILURE_NOTE_PREFIX, Event, EventKind, Phase
from ettr.integrations._commits import CHECKPOINT_FILE_MARK
from ettr.recorder import RecorderProtocol

_OWN_PHASES = (Phase.CHECKPOINT_BLOCKING, Phase.CHECKPOINT_PERSIST)


def _path_of(target: Any) -> str | None:
    return path_of(target)


FULL_BELOW_BYTES = 1 << 20
"""A file system with less room than this after a save raised is full: that is why it raised."""


def full_disk_note(path: str, exc: BaseException, statvfs: Callable[[str], Any] = os.statvfs) -> str | None:
    """Why a checkpoint save raised, when its file system is full (`errno.ENOSPC` in the exception or its
    chain, or under `FULL_BELOW_BYTES` left): torch's own words for a full disk are `basic_ios::clear:
    iostream error` or `unexpected pos N vs M` (field trial: the tutorial's snapshot on a full tmpfs read
    `user (exception): RuntimeError: basic_ios::clear: iostream error`, nothing about the disk). None otherwise."""
    if "://" in path:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fs = statvfs(directory)
        free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    except (OSError, AttributeError, TypeError):
        return None
    chain: BaseException | None = exc
    seen, enospc = 0, False
    while chain is not None and seen < 10:
        enospc = enospc or getattr(chain, "errno", None) == errno.ENOSPC
        chain, seen = chain.__cause__ or chain.__context__, seen + 1
    if not enospc and free >= FULL_BELOW_BYTES:
        return None
    return (
        f"the file system of {directory} is full ({free} of {size} bytes free) while saving {path}: "
        "free space there, or save elsewhere; the file the save left may be cut off"
    )


def _dcp_path(kwargs: dict[str, Any], storage_key: str) -> str | None:
    path = _path_of(kwargs.get("checkpoint_id"))
    if path is None:
        storage = kwargs.get(storage_key)
        path = _path_of(getattr(storage, "path", None))
    return path


class CheckpointHooks:
    """Records checkpoint saves and loads of one process (see the module docstring)."""

    def __init__(self, rec: RecorderProtocol, steps: StepCounter, *, guard: Guard, patcher: Patcher) -> None:
        self.rec = rec
        self.patcher = patcher
        self.steps = steps
        self.guard = guard
        self._local = threading.local()
        self._pending_renames: dict[str, int] = {}  # saved path -> step, until renamed or superseded
        self._earlier: SaveIndex | None = None
        self._saved_this_attempt: frozenset[str] = frozenset()  # identities of files this attempt saved
        self._job_start_ts: float | None = None
        self._books_unreadable: str | None = None  # why the last read of the job's books failed
        self._resumed = False
        self._unknown_resume: tuple[str, tuple[str, int] | None] | None = None  # (reason, step in the object)
        self._data_resume: int | None = None  # the step of a data file an earlier attempt saved, if loaded
        self._committed_steps: set[int] = set()
        self._buffer_save: BufferSave | None = None
        self._give_back_open: Callable[[], None] | None = None  # while a buffer save may be written
        self._atexit = False
        self._async_paths: set[str] = set()  # async saves in flight: their inner save is not another one
        self._window_atexit = False
        self.window = SaveWindow(self._book_blocking)  # a save lasts to the end of the script's save function
        # Told of what a load returned once this process trained (EvalHooks: a model loaded whole is trained)
        self.loaded_after_training: Callable[[Any], None] | None = None

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return getattr(self._local, "busy", False)

    def _set_busy(self, value: bool) -> None:
        self._local.busy = value

    def earlier_commits(self) -> SaveIndex:
        """Every file of the checkpoints that earlier attempts of this job committed, with the step and the
        identity each save left (read once: CHECKPOINT_COMMIT paths and `checkpoint_file` marks)."""
        if self._earlier is None:
            events: list[Event] = []
            if self.rec.run_dir is not None:
                from ettr.ledger import LedgerError, read_run_events

                try:  # the job's books, wherever `ettr run --ledger` put them
                    events = read_run_events(self.rec.run_dir)
                except LedgerError as exc:  # a ledger server away: nothing is known, so nothing is ruled out
                    self._books_unreadable = str(exc)
                    return SaveIndex.from_events((), before_attempt=0, file_mark=CHECKPOINT_FILE_MARK)
                self._books_unreadable = None
                if events:
                    self._job_start_ts = min(e.ts for e in events)
            self._earlier = SaveIndex.from_events(
                events, before_attempt=self.rec.attempt, file_mark=CHECKPOINT_FILE_MARK
            )
            self._saved_this_attempt = identities_saved_in(
                events, self.rec.attempt, file_mark=CHECKPOINT_FILE_MARK
            )
        return self._earlier

    def _saved_by_this_attempt(self, identity: str | None) -> bool:
        """The file (its identity now) is one that an earlier process of this attempt saved (a wrapper's
        `python prepare.py && python train.py`, the first writing the data the second loads): the attempt's
        own file, not a resume of an earlier attempt's save nor a checkpoint rewritten behind ettr's back."""
        self.earlier_commits()
        return identity is not None and identity in self._saved_this_attempt

    def _quiet(self, call: Callable[[], Any]) -> Any:
        """Run a call ettr's own code made (it records itself): nested calls are not recorded either."""
        self._set_busy(True)
        try:
            return call()
        finally:
            self._set_busy(False)

    def _quiet_async(self, path: str | None, call: Callable[[], Any]) -> Any:
        """`_quiet` for an async save: its inner save, on DCP's own thread, is not recorded until it is done."""
        if path is None:
            return self._quiet(call)
        self._async_paths.add(path)
        try:
            result = self._quiet(call)
        except BaseException:
            self._async_paths.discard(path)
            raise
        future = getattr(result, "upload_completion", result)
        if hasattr(future, "add_done_callback"):
            future.add_done_callback(lambda _: self._async_paths.discard(path))
        else:
            self._async_paths.discard(path)
        return result

    def _recorded_elsewhere(self) -> bool:
        """User code or a framework callback records this save itself (and commits it when it is durable)."""
        return any(self.rec.is_open(phase) for phase in _OWN_PHASES)

    def _commit(self, step: int, path: str) -> None:
        """One commit per checkpoint: the first file of a step commits it, later ones are marks. Each carries
        the file's identity as this save left it, which a later attempt's load is matched against."""
        identity = file_identity(path)
        if step in self._committed_steps:
            self.rec.mark(CHECKPOINT_FILE_MARK, step=step, path=path, **{IDENTITY_KEY: identity})
        else:
            self._committed_steps.add(step)
            # `rec.checkpoint_committed`'s event, with the identity beside the path (an added data key)
            self.rec.record(
                EventKind.CHECKPOINT_COMMIT, step=step, data={"path": path, IDENTITY_KEY: identity}
            )
            # In the books now, not within the writer's next half second: a SIGTERM handler that saves and
            # then re-raises the signal with SIG_DFL ends the process before that.
            self.rec.flush(timeout_s=COMMIT_FLUSH_S)

    def _book_blocking(self, begin: float, end: float, step: int, path: str) -> None:
        self.guard.call(
            "checkpoint save", self.rec.span, Phase.CHECKPOINT_BLOCKING, begin, end, step=step, path=path
        )

    def training_resumes(self) -> None:
        """A backward pass, an optimizer step or an evaluation begins: a save's window ends here at the
        latest (`save_window`). Cheap when none is open; never raises."""
        if self.window.is_open:
            self.guard.call("checkpoint save", self.window.close)

    def _saved(self, path: str, step: int, begin: float) -> None:
        if self._recorded_elsewhere():
            return
        self._commit(step, path)  # the file is written: the resume point is claimed now, the wait below
        self.window.saved(begin, step, path, sys._getframe())  # noqa: SLF001 - where the save was called from
        if self.window.is_open and not self._window_atexit:
            self._window_atexit = True
            atexit.register(self.training_resumes)  # a window still open at exit (a save right before it)
        if len(self._pending_renames) > 64:
            self._pending_renames.clear()
        self._pending_renames[path] = step

    def _attribution(self, path: str | None, before_training: bool) -> Attribution | None:
        """Which earlier save the loaded file is (None: none of this job's saves). Only a file saved under
        this path, or any file loaded before training in a later attempt, is fingerprinted."""
        if path is None:
            return None
        earlier = self.earlier_commits()
        if path not in earlier and not (before_training and self.rec.attempt > 0 and earlier.by_identity):
            return None
        identity = file_identity(path)
        if self._saved_by_this_attempt(identity):
            return None
        return earlier.attribute(path, identity)

    def _loaded(self, path: str | None, begin: float, loaded: Any, *, state: bool | None = None) -> None:
        """A load returned `loaded` (`state`: whether it holds training state, when the caller knows)."""
        before_training = self.steps.num_steps == 0 and not self.rec.explicit_steps
        if not before_training and self.loaded_after_training is not None:
            self.loaded_after_training(loaded)
        found = self._attribution(path, before_training)
        step = found.step if found is not None else None
        if found is None and not before_training:
            return
        # Inside the script's own RESTORE phase the span is the script's; the resume is still recorded (a
        # later `ettr.resumed_from` by the script wins: the accounting takes an attempt's last RESUMED).
        owned = self.rec.is_open(Phase.RESTORE)  # a script's or framework's own restore phase
        holds_state = owned or (holds_training_state(loaded) if state is None else state)
        if found is None and not holds_state:
            return  # data no save of this job left: start-up work (init), not a restore nor a resume
        if not owned:
            # A load of a file is a restore from storage (the report's `(restored from)` row said `?` for
            # Lightning Fabric's build_your_own_trainer, resumed from epoch-0004.ckpt by torch.load); of an
            # in-memory buffer, from where the bytes came is unknown.
            if path is not None:
                self.rec.span(Phase.RESTORE, begin, step=step, path=path, source="storage")
            else:
                self.rec.span(Phase.RESTORE, begin, step=step, path="<in-memory buffer>")
        if self._resumed or not before_training:
            return
        if step is not None and not holds_state:
            # Data this job saved at `step` (a cache written by an earlier attempt): its step is the resume only
            # if no load of training state says otherwise by the first step.
            if self._data_resume is None:
                self._data_resume = step
        elif step is not None:
            self._resume_at(step)
        elif not owned and self.rec.attempt > 0 and self._unknown_resume is None:
            # Inside an owned restore phase the owner says where it resumed (the frameworks' callbacks do)
            reason = found.reason if found is not None else self._unmatched_reason(path)
            if reason is not None:
                self._unknown_resume = (reason, step_in(loaded))

    def _unmatched_reason(self, path: str | None) -> str | None:
        """Why a load before training in a later attempt may be a resume the hooks cannot place (None: it
        is not one, e.g. pretrained weights that predate the job)."""
        if path is None:
            return "the checkpoint was loaded from an in-memory buffer"
        if self._books_unreadable is not None:
            return f"{path} was loaded while the job's books could not be read ({self._books_unreadable})"
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = None
        start = self._job_start_ts
        if mtime is not None and start is not None and mtime < start:
            return None
        if self._saved_by_this_attempt(file_identity(path)):
            return None
        return f"{path} was loaded but no earlier attempt was seen saving it"

    def new_generation(self) -> None:
        """A restart in place: the next generation's first load of training state is its resume again, its
        books are the next attempt's, and the saves of earlier attempts include this process's own of the
        generation before. They are read again (`earlier_commits`, read once per attempt): read at attempt A,
        they held none of A's saves, and a survivor's load of the checkpoint it had committed itself in A
        read as a resume of unknown step, where its replacement's load of the same file was placed
        (pytorch/examples' DDP tutorial with `ettr.resilient`, a rank SIGKILLed: the survivor's steps were
        numbered from 1 again, the replacement's from the snapshot's 32). Its steps commit anew, as a fresh
        process of the attempt's would."""
        self._resumed, self._unknown_resume, self._data_resume = False, None, None
        self._earlier = None
        self._committed_steps.clear()
        self.training_resumes()

    def _save_step(self) -> int:
        """The global step a save made now holds: the step count, or, before this attempt's first step, the
        step of a load that the first step would settle (a resume placed by the loaded checkpoint's own step,
        or by a data file this job saved). nanoGPT evaluates and saves at the iteration it resumed at, before
        its first step: counted from 0 that save was committed at step 0, and a later resume from it read as
        a restart from scratch. A resume of unknown step leaves the count as it is (the limit in the docs)."""
        if self.steps.num_steps == 0 and not self.rec.explicit_steps and not self._resumed:
            if self._unknown_resume is not None and self._unknown_resume[1] is not None:
                return self._unknown_resume[1][1]
            if self._data_resume is not None:
                return self._data_resume
        return self.steps.current_step

    def _resume_at(self, step: int) -> None:
        self._resumed = True
        self.steps.resumed(step)
        self.rec.resumed_from(step)

    def before_step(self) -> None:
        """Called at each optimizer step, before it is counted: settle what start-up left open."""
        self.training_resumes()
        self.window.loop.at_step()
        if self._buffer_save is not None:
            self._settle_buffer_save()
        if self._unknown_resume is not None and not self._resumed:
            reason, found = self._unknown_resume
            self._unknown_resume = None
            self._resumed = True
            if found is not None:
                self.steps.resumed(found[1])
                self.rec.resumed_from(found[1])
            else:
                self.rec.record(EventKind.RESUMED, data={"unknown": reason})
        if self._data_resume is not None:
            step, self._data_resume = self._data_resume, None
            if not self._resumed:
                self._resume_at(step)

    def _renamed(self, src: Any, dst: Any) -> None:
        source, target = _path_of(src), _path_of(dst)
        if self._buffer_save is not None:
            self._buffer_save.renamed(source, target)
        if not self._pending_renames:
            return
        step = self._pending_renames.pop(source, None) if source is not None else None
        if step is not None and target is not None:
            self._commit(step, target)

    # -- in-memory buffers written to a file ----------------------------------------------------------------
    def _buffer_saved(self, step: int, begin: float) -> None:
        if self._recorded_elsewhere():
            return
        if self._buffer_save is not None:
            self._settle_buffer_save(keep_open_hook=True)
        self._buffer_save = BufferSave(step, begin, time.time(), threading.get_ident())
        if self._give_back_open is None:
            hooks = self

            def make_open(original: Callable[..., Any]) -> Callable[..., Any]:
                def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001
                    result = original(file, mode, *args, **kwargs)
                    pending = hooks._buffer_save
                    if (
                        pending is not None
                        and pending.thread_id == threading.get_ident()
                        and is_binary_write(mode)
                    ):
                        hooks.guard.call(
                            "checkpoint buffer", lambda: pending.opened_for_write(_path_of(result))
                        )
                    return result

                return open

            self._give_back_open = self.patcher.wrap_for_now(builtins, "open", make_open)
        if not self._atexit:
            self._atexit = True
            atexit.register(self.guard.call, "checkpoint buffer", self._settle_buffer_save)

    def _settle_buffer_save(self, *, keep_open_hook: bool = False) -> None:
        pending, self._buffer_save = self._buffer_save, None
        if self._give_back_open is not None and not keep_open_hook:
            give_back, self._give_back_open = self._give_back_open, None
            give_back()
        if pending is None or pending.target is None:
            return  # never written to a file: serialization, not a checkpoint
        end = pending.written_until()
        self.rec.span(
            Phase.CHECKPOINT_BLOCKING, pending.begin_ts, end, step=pending.step, path=pending.target
        )
        self._commit(pending.step, pending.target)

    # -- torch.save / torch.load ---------------------------------------------------------------------------
    def install_torch(self, torch: ModuleType) -> None:
        hooks = self

        def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
            def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
                # inside another save: a library writing through torch.save is part of it, but a script's
                # own save (its SIGTERM handler, run again by a second SIGTERM mid-save) is a save
                if hooks._busy() and is_library_frame(sys._getframe(1)):  # noqa: SLF001 - the caller
                    return original(obj, f, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(obj, f, *args, **kwargs))
                path = _path_of(f)
                if path is None:
                    if is_buffer(f):
                        return hooks._timed_buffer_save(lambda: original(obj, f, *args, **kwargs))
                    return original(obj, f, *args, **kwargs)
                return hooks._timed_save(path, lambda: original(obj, f, *args, **kwargs))

            return save

        def make_load(original: Callable[..., Any]) -> Callable[..., Any]:
            def load(f: Any, *args: Any, **kwargs: Any) -> Any:
                if hooks._busy():
                    return original(f, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(f, *args, **kwargs))
                path = _path_of(f)
                if path is None and not is_buffer(f):
                    return original(f, *args, **kwargs)
                return hooks._timed_load(path, lambda: original(f, *args, **kwargs))

            return load

        self.patcher.wrap(torch.serialization, "save", make_save)
        self.patcher.wrap(torch.serialization, "load", make_load)
        self.patcher.set(torch, "save", torch.serialization.save)
        self.patcher.set(torch, "load", torch.serialization.load)

        def make_rename(original: Callable[..., Any]) -> Callable[..., Any]:
            def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(src, dst, *args, **kwargs)
                if hooks._pending_renames or hooks._buffer_save is not None:
                    hooks.guard.call("checkpoint rename", hooks._renamed, src, dst)
                return result

            return rename

        self.patcher.wrap(os, "replace", make_rename)
        self.patcher.wrap(os, "rename", make_rename)
        self.patcher.on_undo(lambda: self.guard.call("checkpoint buffer", self._settle_buffer_save))
        self.patcher.on_undo(self.training_resumes)
        self.patcher.on_undo(lambda: atexit.unregister(self.training_resumes))

    def install_safetensors(self, module: ModuleType) -> None:
        """safetensors.torch: `save_file` and `load_file` are checkpoint files like torch.save/load's."""
        hooks = self

        def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
                path = _path_of(filename)
                if hooks._busy() or path is None:
                    return original(tensors, filename, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(tensors, filename, *args, **kwargs))
                return hooks._timed_save(path, lambda: original(tensors, filename, *args, **kwargs))

            return save_file

        def make_load(original: Callable[..., Any]) -> Callable[..., Any]:
            def load_file(filename: Any, *args: Any, **kwargs: Any) -> Any:
                path = _path_of(filename)
                if hooks._busy() or path is None:
                    return original(filename, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(filename, *args, **kwargs))
                # a safetensors file is a model's weights (its format holds nothing else of a checkpoint)
                return hooks._timed_load(path, lambda: original(filename, *args, **kwargs), state=True)

            return load_file

        self.patcher.wrap(module, "save_file", make_save)
        self.patcher.wrap(module, "load_file", make_load)

    def _timed_save(self, path: str, call: Callable[[], Any]) -> Any:
        # a SIGTERM or SIGINT during the write waits for the file and its commit (`save_signals`)
        with held_stop_signals(path):
            step = self.guard.call("checkpoint save", self._save_step)
            begin = time.time()
            outer = self._busy()  # a save of the script's made inside another one (a signal handler's)
            self._set_busy(True)
            try:
                inject.checkpoint_in_progress()
                result = call()
            except BaseException as exc:
                note = self.guard.call("checkpoint save", full_disk_note, path, exc)
                if note:
                    exc.add_note(f"{FAILURE_NOTE_PREFIX}{note}")
                self.guard.call(
                    "checkpoint save",
                    self.rec.span,
                    Phase.CHECKPOINT_BLOCKING,
                    begin,
                    step=step,
                    path=path,
                    error=type(exc).__name__,
                )
                raise
            finally:
                self._set_busy(outer)
            if step is not None:
                self.guard.call("checkpoint save", self._saved, path, step, begin)
            return result

    def _timed_buffer_save(self, call: Callable[[], Any]) -> Any:
        step = self.guard.call("checkpoint save", self._save_step)
        begin = time.time()
        self._set_busy(True)
        try:
            result = call()
        finally:
            self._set_busy(False)
        if step is not None:
            self.guard.call("checkpoint buffer", self._buffer_saved, step, begin)
        return result

    def _timed_load(self, path: str | None, call: Callable[[], Any], *, state: bool | None = None) -> Any:
        begin = time.time()
        self._set_busy(True)
        try:
            result = call()
        except Exception as exc:
            self.guard.call("checkpoint load", self._load_failed, path, exc)
            raise
        finally:
            self._set_busy(False)
        self.guard.call("checkpoint load", lambda: self._loaded(path, begin, result, state=state))
        return result

    def _load_failed(self, path: str | None, exc: Exception) -> None:
        """A load raised: when the file is one of this job's checkpoints but none of the saves recorded for it
        (a torch.save straight to the final name, its process killed mid-write, leaves a truncated file that
        every restart fails to load: `EOFError`, `failed finding central directory`), say so on the exception
        (a note, in the traceback and in the rank's FAILURE) and in a `checkpoint_load_failed` mark."""
        if path is None or "://" in path or path not in self.earlier_commits():
            return
        identity = file_identity(path)
        if self._saved_by_this_attempt(identity):
            return  # this attempt's own file (an earlier process of it wrote it): intact as far as ettr knows
        found = self.earlier_commits().attribute(path, identity)
        if found is None or found.rewritten_since is None:
            return  # the very file a save left (another cause), or nothing to compare with
        try:
            info = os.stat(path)
        except OSError:
            return
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.st_mtime))
        why = (
            f"{path} ({info.st_size} bytes, written {written}) is none of the checkpoints this job saved there"
            f" ({found.rewritten_since}): a save cut off mid-write? Every restart that loads it fails: put the last good one"
            " back, or remove it to start over"
        )
        exc.add_note(f"{FAILURE_NOTE_PREFIX}{why}")
        self.rec.mark(CHECKPOINT_LOAD_FAILED_MARK, path=path, exception=type(exc).__name__, why=why)

    # -- torch.distributed.checkpoint ----------------------------------------------------------------------
    def install_dcp(self, dcp: ModuleType) -> None:
        hooks = self

        def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
            def save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
                if hooks._busy():
                    return original(state_dict, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(state_dict, *args, **kwargs))
                path = _dcp_path(kwargs, "storage_writer")
                if path is None or path in hooks._async_paths:  # an async save's own inner save
                    return original(state_dict, *args, **kwargs)
                return hooks._timed_save(path, lambda: original(state_dict, *args, **kwargs))

            return save

        def make_async_save(original: Callable[..., Any]) -> Callable[..., Any]:
            def async_save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
                if hooks._busy():
                    return original(state_dict, *args, **kwargs)
                path = _dcp_path(kwargs, "storage_writer")
                if called_from_ettr():
                    return hooks._quiet_async(path, lambda: original(state_dict, *args, **kwargs))
                if path is None:
                    return original(state_dict, *args, **kwargs)
                return hooks._timed_async_save(path, lambda: original(state_dict, *args, **kwargs))

            return async_save

        def make_load(original: Callable[..., Any]) -> Callable[..., Any]:
            def load(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
                if hooks._busy():
                    return original(state_dict, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(state_dict, *args, **kwargs))
                path = _dcp_path(kwargs, "storage_reader")
                if path is None:
                    return original(state_dict, *args, **kwargs)
                # DCP loads into the state dict it is given: training state, whatever it returns
                return hooks._timed_load(path, lambda: original(state_dict, *args, **kwargs), state=True)

            return load

        for module in (getattr(dcp, "state_dict_saver", None), dcp):
            if module is None:
                continue
            self.patcher.wrap(module, "save", make_save)
            self.patcher.wrap(module, "async_save", make_async_save)
        for module in (getattr(dcp, "state_dict_loader", None), dcp):
            if module is not None:
                self.patcher.wrap(module, "load", make_load)

    def _timed_async_save(self, path: str, call: Callable[[], Any]) -> Any:
        step = self.guard.call("checkpoint save", self._save_step)
        begin = time.time()
        self._set_busy(True)
        self._async_paths.add(path)
        try:
            inject.checkpoint_in_progress()
            result = call()
        except BaseException:
            self._async_paths.discard(path)
            raise
        finally:
            self._set_busy(False)
        staged = time.time()
        future = getattr(result, "upload_completion", result)  # AsyncSaveResponse or a plain Future
        watched = step is not None and hasattr(future, "add_done_callback")
        # `persist`: it goes on in the background, its CHECKPOINT_PERSIST span to come (a hang's pulse says so)
        extra = {"persist": "async"} if watched else {}
        self.guard.call(
            "checkpoint save",
            self.rec.span,
            Phase.CHECKPOINT_BLOCKING,
            begin,
            staged,
            step=step,
            path=path,
            **extra,
        )
        if watched:
            rec, guard = self.rec, self.guard

            def done(fut: Any) -> None:
                self._async_paths.discard(path)

                def record() -> None:
                    error = fut.exception()
                    rec.span(Phase.CHECKPOINT_PERSIST, staged, step=step, path=path)
                    if error is None:
                        self._commit(step, path)
                    else:
                        rec.checkpoint_error(step, path, error)

                guard.call("async checkpoint commit", record)

            future.add_done_callback(done)
        else:
            self._async_paths.discard(path)
        return result
