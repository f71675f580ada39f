"""`ettr.patcher.Patcher` (the bootstrap, the eval hooks, the audit): every patch it makes is undone by `undo`,
newest first; a patch given back early (`wrap_for_now`, as the buffer-save hook does with builtins.open) is put
back at once and not undone twice; one set `unless_replaced` leaves a later wrapper alone."""

from __future__ import annotations

import types

from ettr.patcher import Patcher


def _owner() -> types.SimpleNamespace:
    return types.SimpleNamespace(f=lambda x: x, g=lambda x: x)


def test_a_patch_given_back_early_is_back_at_once_and_undo_leaves_it_alone():
    owner, patcher = _owner(), Patcher()
    f, g = owner.f, owner.g
    give_back = patcher.wrap_for_now(owner, "f", lambda original: lambda x: original(x) + 1)
    assert give_back is not None and owner.f(1) == 2 and owner.f.__wrapped__ is f
    assert patcher.wrap_for_now(owner, "f", lambda original: original) is None  # ours already
    patcher.wrap(owner, "g", lambda original: lambda x: original(x) * 10)
    give_back()
    assert owner.f is f and owner.g(1) == 10
    give_back()  # twice: nothing more
    owner.f = replacement = lambda x: -x  # someone else's patch after ours was given back
    patcher.undo()
    assert owner.f is replacement and owner.g is g  # undo puts back only what is still ours


def test_undo_puts_back_newest_first_and_removes_what_was_added():
    owner, patcher, calls = _owner(), Patcher(), []
    f = owner.f
    patcher.set(owner, "f", 1)
    patcher.set(owner, "f", 2)
    patcher.set(owner, "new", 3)
    patcher.on_undo(lambda: calls.append("hook"))
    patcher.undo()
    assert owner.f is f and not hasattr(owner, "new") and calls == ["hook"]


def test_a_patch_set_unless_replaced_leaves_a_later_wrapper_alone():
    owner, patcher = _owner(), Patcher()
    f = owner.f
    give_back = patcher.set(owner, "f", ours := (lambda x: f(x)), unless_replaced=True)
    owner.f = theirs = lambda x: ours(x) + 1  # wrapped after us (a profiler, a second audit)
    give_back()
    assert owner.f is theirs
    patcher.set(owner, "g", 5, unless_replaced=True)
    patcher.undo()
    assert owner.g(2) == 2  # still ours at the undo: put back


def test_undo_with_on_error_undoes_the_rest_and_reports_each_error():
    owner, patcher, errors = _owner(), Patcher(), []
    g = owner.g
    patcher.set(owner, "g", 1)
    patcher.on_undo(lambda: 1 / 0)
    patcher.undo(on_error=errors.append)
    assert owner.g is g and len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
