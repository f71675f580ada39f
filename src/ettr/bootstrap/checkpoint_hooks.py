"""Checkpoint hooks of the bootstrap: saves and loads through torch.save/load and torch.distributed.checkpoint.

Saves: the call is a CHECKPOINT_BLOCKING span at the current global step; once it has returned (not before),
CHECKPOINT_COMMIT(step, path), so a resume point is only claimed for a file that was written. A save that
is renamed into place (`torch.save(tmp)` then `os.replace(tmp, final)`) commits the final path at the
rename. `dcp.async_save` blocks for the staging only: its call is the blocking span, and the commit (with
a CHECKPOINT_PERSIST span for the overlapped upload) comes when its future completes.

Loads: a load whose path matches a checkpoint committed by an earlier attempt (read from the ledger at the
first load) is a RESTORE span and RESUMED(step) — the attempt's global steps then count on from that step.
Other loads before the first step are RESTORE spans too (pretrained weights); later unmatched loads are the
script's business (data, evaluation) and not recorded.

Only path-like targets are checkpoints (a save to a BytesIO is serialization, not a checkpoint); calls made
by ettr's own modules (the checkpoint manager records itself) and nested calls (dcp writing through
torch.save) are not recorded twice. `--inject KIND@checkpoint` fires inside the save, before the data is
written, so that checkpoint never commits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr import inject
from ettr.bootstrap.hooks import Guard, Patcher, StepCounter, called_from_ettr
from ettr.events import EventKind, Phase
from ettr.recorder import RecorderProtocol


def _path_of(target: Any) -> str | None:
    if isinstance(target, (str, os.PathLike)):
        try:
            return os.path.realpath(os.fspath(target))
        except (TypeError, ValueError):
            return None
    return None


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
        self._earlier_commits: dict[str, int] | None = None
        self._resumed = False
        self._async_paths: set[str] = set()  # async saves in flight: their inner save is not another one

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return getattr(self._local, "busy", False)

    def _set_busy(self, value: bool) -> None:
        self._local.busy = value

    def earlier_commits(self) -> dict[str, int]:
        """path -> step of the checkpoints committed by earlier attempts of this job (read once)."""
        if self._earlier_commits is None:
            found: dict[str, int] = {}
            run_dir = self.rec.run_dir
            if run_dir is not None:
                from ettr.ledger import read_run_events

                for e in read_run_events(run_dir):
                    path = (e.data or {}).get("path")
                    if (
                        e.kind is EventKind.CHECKPOINT_COMMIT
                        and e.attempt < self.rec.attempt
                        and e.step is not None
                        and path
                    ):
                        found[os.path.realpath(str(path))] = e.step
            self._earlier_commits = found
        return self._earlier_commits

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

    def _saved(self, path: str, step: int, begin: float) -> None:
        if self.rec.is_open(Phase.CHECKPOINT_BLOCKING):
            return  # the script records its own saves (and commits them when they are durable)
        self.rec.span(Phase.CHECKPOINT_BLOCKING, begin, step=step, path=path)
        self.rec.checkpoint_committed(step, path)
        if len(self._pending_renames) > 64:
            self._pending_renames.clear()
        self._pending_renames[path] = step

    def _loaded(self, path: str, begin: float) -> None:
        step = self.earlier_commits().get(path)
        before_training = self.steps.num_steps == 0 and not self.rec.explicit_steps
        if step is None and not before_training:
            return
        # Inside the script's own RESTORE phase the span is the script's; the resume is still recorded (a
        # later `ettr.resumed_from` by the script wins: the accounting takes an attempt's last RESUMED).
        if not self.rec.is_open(Phase.RESTORE):
            self.rec.span(Phase.RESTORE, begin, step=step, path=path)
        if step is not None and before_training and not self._resumed:
            self._resumed = True
            self.steps.resumed(step)
            self.rec.resumed_from(step)

    def _renamed(self, src: Any, dst: Any) -> None:
        if not self._pending_renames:
            return
        source = _path_of(src)
        step = self._pending_renames.pop(source, None) if source is not None else None
        target = _path_of(dst)
        if step is not None and target is not None:
            self.rec.checkpoint_committed(step, target)

    # -- torch.save / torch.load ---------------------------------------------------------------------------
    def install_torch(self, torch: ModuleType) -> None:
        hooks = self

        def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
            def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
                if hooks._busy():
                    return original(obj, f, *args, **kwargs)
                if called_from_ettr():
                    return hooks._quiet(lambda: original(obj, f, *args, **kwargs))
                path = _path_of(f)
                if path is None:
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
                if path is None:
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
                if hooks._pending_renames:
                    hooks.guard.call("checkpoint rename", hooks._renamed, src, dst)
                return result

            return rename

        self.patcher.wrap(os, "replace", make_rename)
        self.patcher.wrap(os, "rename", make_rename)

    def _timed_save(self, path: str, call: Callable[[], Any]) -> Any:
        step = self.guard.call("checkpoint save", lambda: self.steps.current_step)
        begin = time.time()
        self._set_busy(True)
        try:
            inject.checkpoint_in_progress()
            result = call()
        except BaseException as exc:
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
            self._set_busy(False)
        if step is not None:
            self.guard.call("checkpoint save", self._saved, path, step, begin)
        return result

    def _timed_load(self, path: str, call: Callable[[], Any]) -> Any:
        begin = time.time()
        self._set_busy(True)
        try:
            result = call()
        finally:
            self._set_busy(False)
        self.guard.call("checkpoint load", self._loaded, path, begin)
        return result

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
                return hooks._timed_load(path, lambda: original(state_dict, *args, **kwargs))

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
        step = self.guard.call("checkpoint save", lambda: self.steps.current_step)
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
        self.guard.call(
            "checkpoint save", self.rec.span, Phase.CHECKPOINT_BLOCKING, begin, staged, step=step, path=path
        )
        future = getattr(result, "upload_completion", result)  # AsyncSaveResponse or a plain Future
        if step is not None and hasattr(future, "add_done_callback"):
            rec, guard = self.rec, self.guard

            def done(fut: Any) -> None:
                self._async_paths.discard(path)

                def record() -> None:
                    error = fut.exception()
                    rec.span(Phase.CHECKPOINT_PERSIST, staged, step=step, path=path)
                    if error is None:
                        rec.checkpoint_committed(step, path)
                    else:
                        rec.checkpoint_error(step, path, error)

                guard.call("async checkpoint commit", record)

            future.add_done_callback(done)
        else:
            self._async_paths.discard(path)
        return result
