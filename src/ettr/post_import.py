"""Run a callback right after a module is first imported, without importing it ourselves.

The bootstrap runs before the user's script has imported torch, and must not import torch itself (seconds,
for a script that may never use it). `when_imported("torch", fn)` calls `fn(module)` once `import torch`
has finished executing torch's `__init__`, before the importing code sees the module; if the module is
already imported, at once. The finder leaves `sys.meta_path` as soon as nothing is left to watch.

The one post-import mechanism of ettr (the bootstrap's torch hooks; compile support waits for
`torch._dynamo` the same way). Imports nothing of ettr.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger("ettr")

Callback = Callable[[ModuleType], None]


class _NotifyingLoader(importlib.abc.Loader):
    """Wraps the real loader: executes the module, then runs the callbacks still watching it (each guarded)."""

    def __init__(self, loader: Any, finder: _PostImportFinder, name: str) -> None:
        self._loader = loader
        self._finder = finder
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its real loader (importlib.resources, inspect and pickle look at it).
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _run_callbacks(module, self._finder.take(self._name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run_callbacks(module: ModuleType, callbacks: list[Callback]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # an instrumentation bug must never fail the user's import
            logger.warning(
                "ettr: post-import hook for %s failed (%s: %s); continuing without it",
                module.__name__,
                type(exc).__name__,
                exc,
            )


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder that only watches a few names and otherwise answers None at once."""

    def __init__(self) -> None:
        self.watched: dict[str, list[Callback]] = {}
        self._lock = threading.RLock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        # The callbacks stay watched until the module is executed: a lookup is no import. transformers and
        # datasets ask `importlib.util.find_spec("torch")` whether torch is installed before they import it;
        # taken at that lookup, the callbacks never ran, and a script that imported transformers before torch
        # had none of the bootstrap's torch hooks (no step recorded: ETT unknown).
        if fullname not in self.watched:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader, self, fullname)
                return spec
        return None

    def take(self, name: str) -> list[Callback]:
        """The callbacks watching `name`, no longer watched (each runs once, for the import that executed it)."""
        with self._lock:
            callbacks = self.watched.pop(name, [])
            if not self.watched:
                _remove(self)
        return callbacks


_finder: _PostImportFinder | None = None
_finder_lock = threading.Lock()


def _remove(finder: _PostImportFinder) -> None:
    global _finder
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass
    with _finder_lock:
        if _finder is finder:
            _finder = None


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once module `name` has been imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        _run_callbacks(module, [callback])
        return
    global _finder
    with _finder_lock:
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
        _finder.watched.setdefault(name, []).append(callback)
