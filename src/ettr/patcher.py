"""`Patcher`: ettr's one way to monkey-patch, every patch undoable (the bootstrap's hooks, the eval hooks'
temporary wrappers, the init communication audit).

A patch is `wrap` (a wrapper around what is there, marked so it is never wrapped twice) or `set` (any value).
Each returns or registers how to put the attribute back; `undo` puts everything back, newest first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

ORIGINAL_ATTR = "__ettr_original__"
"""The attribute on a wrapper made by `Patcher.wrap` that holds what it wraps (how ettr knows its own)."""


class Patcher:
    """Replaces attributes by wrappers and remembers how to put everything back (`undo`, for tests)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
        """Replace `owner.name` by `make(original)` unless it is already ours; whether it did."""
        return self.wrap_for_now(owner, name, make) is not None

    def wrap_for_now(
        self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> Callable[[], None] | None:
        """`wrap`, for a while: the callable it returns puts `owner.name` back at once (else `undo` does);
        None when `owner.name` is missing or already ours."""
        original = getattr(owner, name, None)
        if original is None or getattr(original, ORIGINAL_ATTR, None) is not None:
            return None
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, ORIGINAL_ATTR, original)
        return self.set(owner, name, wrapper)

    def set(self, owner: Any, name: str, value: Any, *, unless_replaced: bool = False) -> Callable[[], None]:
        """`setattr(owner, name, value)`, undoably; the callable it returns undoes this one now (once).

        `unless_replaced`: the undo leaves `owner.name` alone when someone replaced `value` since (a later
        wrapper stays; ours, still inside it, must then pass calls straight through)."""
        had, old = hasattr(owner, name), getattr(owner, name, None)
        setattr(owner, name, value)

        def restore() -> None:
            if unless_replaced and getattr(owner, name, None) is not value:
                return
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)

        def give_back() -> None:
            if restore in self._undo:  # not undone yet
                self._undo.remove(restore)
                restore()

        self._undo.append(restore)
        return give_back

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Call `fn` on `undo` (removing a registered hook)."""
        self._undo.append(fn)

    def undo(self, *, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Put back everything, newest first. An error of one undo raises, unless `on_error` takes it (then
        the others are still undone)."""
        while self._undo:
            restore = self._undo.pop()
            if on_error is None:
                restore()
                continue
            try:
                restore()
            except Exception as exc:
                on_error(exc)
