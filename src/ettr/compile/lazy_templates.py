"""Inductor's kernel templates compiled at their first use, not when inductor is imported.

Importing inductor's compile path (`torch._inductor.compile_fx`, at a process's first `torch.compile`)
compiles the Jinja templates of its GPU kernels (23 Triton and 3 CuTe DSL ones) as their modules are
imported: ~0.25 s of CPU per process here, on the start-up path of a CPU job that never renders one. `defer`
makes `KernelTemplate._template_from_string` hand out a `LazyTemplate`, which compiles the same source in the
same environment (with the same filters) when it is first used. Only when a template is compiled changes: a
template with a syntax error raises at its first use instead of at the import; pickling or copying one
pickles or copies the compiled template, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ettr import torch_compat
from ettr.patcher import ORIGINAL_ATTR, Patcher

logger = logging.getLogger("ettr")


class LazyTemplate:
    """A template compiled (by `compile_`, from `source`) at its first use; anything else is the compiled
    template's."""

    __slots__ = ("_compile", "_source", "_template")

    def __init__(self, compile_: Callable[[str], Any], source: str) -> None:
        self._compile = compile_
        self._source = source
        self._template: Any = None

    def compiled(self) -> Any:
        """The compiled template (compiled now if it was not; two threads may both compile it)."""
        template = self._template
        if template is None:
            template = self._template = self._compile(self._source)
        return template

    def render(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled().render(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in LazyTemplate.__slots__ or name.startswith(
            "__"
        ):  # (unpickling, protocols: not the template's)
            raise AttributeError(name)
        return getattr(self.compiled(), name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.compiled().__reduce_ex__(protocol)


def defer(patcher: Patcher) -> bool:
    """Make inductor's kernel templates compile at their first use (see the module docstring), unless Jinja is
    missing (inductor then hands out None for a template, which stays so) or inductor moved the method;
    whether they do now. Imports inductor's codegen base (`torch._inductor.codegen.common`)."""
    try:
        owner = torch_compat.inductor_kernel_template_class()
    except ImportError as exc:
        logger.debug("ettr: inductor's kernel templates compile at import (%s)", exc)
        return False
    original = owner.__dict__.get("_template_from_string")
    if not isinstance(original, staticmethod):
        return False
    if getattr(original.__func__, ORIGINAL_ATTR, None) is not None:
        return True  # ours already
    compile_ = original.__func__

    def template_from_string(source: str) -> LazyTemplate:
        return LazyTemplate(compile_, source)

    setattr(template_from_string, ORIGINAL_ATTR, compile_)
    # Put back as the staticmethod it was (`Patcher.set` would put back what the class hands out: the bare
    # function, which would then be called as a method).
    owner._template_from_string = staticmethod(template_from_string)
    patcher.on_undo(lambda: setattr(owner, "_template_from_string", original))
    return True
