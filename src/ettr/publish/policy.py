"""What a publisher lets a request do: which model code it may run and which paths it may touch.

A publish request is data written by whoever can write the queue directory, but it names code (a model
factory and config class, imported and called) and paths (the anchor read, the artifact and the publish
job's run directory written). The operator who starts `ettr publish` decides both, and `PublishPolicy`
enforces it before anything of the request is imported, opened or created:

    factory, config_type   must match an allow-list entry: `module:callable` (exactly that one), or
                           `package.*` (any public callable defined in `package` or a module below it); an
                           entry point in the group `ettr.publish_factories` (installed by the operator)
                           allows its value exactly.
    pythonpath             each entry must already be on the publisher's `sys.path` or lie inside an
                           `--allow-pythonpath` directory (never the queue's roots: who writes the queue
                           could plant code there).
    anchor_root, artifact_dir, run_dir
                           absolute, and inside one of the roots (`--root`, default: the directory that
                           holds the queue); a URL anchor root only under a URL root given as a prefix.

See docs/trust.md for the whole trust model.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr.publish.request import PublishError, PublishRequest

FACTORY_ENTRY_POINTS = "ettr.publish_factories"
"""Entry-point group whose values (`module:callable`) a publisher allows as factories or config types."""

_EXACT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_WILDCARD = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.\*$")


def parse_allow_entry(text: str) -> str:
    """Check one `--allow-factory` entry; returns it. Raises ValueError saying the accepted forms."""
    if _EXACT.match(text) or _WILDCARD.match(text):
        return text
    raise ValueError(f"--allow-factory {text!r}: give MODULE:CALLABLE (e.g. mypkg.model:build) or MODULE.*")


def entry_point_factories(group: str = FACTORY_ENTRY_POINTS) -> tuple[str, ...]:
    """The `module:callable` values of the installed entry points of `group` (malformed ones skipped)."""
    values = []
    for entry in importlib.metadata.entry_points(group=group):
        value = entry.value.replace(" ", "")
        if _EXACT.match(value):
            values.append(value)
    return tuple(values)


def _is_url(text: str) -> bool:
    return "://" in text


def _inside(path: str, roots: Iterable[Path]) -> bool:
    """Whether the absolute local `path` (symlinks of its existing part resolved) lies in one of `roots`."""
    resolved = Path(os.path.realpath(path))
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


def _url_inside(url: str, prefixes: Iterable[str]) -> bool:
    if any(part in ("..", ".") for part in url.split("://", 1)[-1].split("/")):
        return False
    return any(url == prefix or url.startswith(prefix.rstrip("/") + "/") for prefix in prefixes)


@dataclass(frozen=True, kw_only=True)
class PublishPolicy:
    """The operator's limits on requests (`ettr publish --allow-factory/--allow-pythonpath/--root`)."""

    allowed_factories: tuple[str, ...]
    """`module:callable` or `package.*` entries (see the module docstring); entry points are added by
    `with_entry_points`."""
    roots: tuple[str, ...]
    """Directories (or URL prefixes) a request's anchor, artifact and run directory must lie in."""
    pythonpath_roots: tuple[str, ...] = ()
    """Directories a request's `pythonpath` entries may lie in (besides the publisher's own sys.path)."""
    allow_unsigned: bool = False
    """Load anchors that are unsigned, or signed with a key the publisher's ring lacks, without
    authentication (`--allow-unsigned`; `ETTR_CHECKPOINT_ALLOW_UNSIGNED=1`). Nothing in an anchor runs as
    code either way (docs/trust.md)."""

    def __post_init__(self) -> None:
        for entry in self.allowed_factories:
            parse_allow_entry(entry)
        if not self.allowed_factories:
            raise ValueError(
                "no model factory is allowed: give --allow-factory MODULE:CALLABLE or MODULE.* "
                f"(or install an entry point in the group {FACTORY_ENTRY_POINTS})"
            )
        if not self.roots:
            raise ValueError("a publisher needs at least one root (--root DIR)")
        for root in (*self.roots, *self.pythonpath_roots):
            if "\0" in root or not root.strip():
                raise ValueError(f"root {root!r} is not a path")
            if not _is_url(root) and not os.path.isabs(root):
                raise ValueError(f"root {root!r} must be an absolute path")

    @classmethod
    def for_queue(
        cls,
        queue_dir: str | os.PathLike[str],
        *,
        allow: Sequence[str] = (),
        roots: Sequence[str] = (),
        pythonpath_roots: Sequence[str] = (),
        entry_points: bool = True,
        allow_unsigned: bool = False,
    ) -> PublishPolicy:
        """A policy with the documented defaults: roots default to the directory holding the queue; the
        installed entry points are allowed too unless `entry_points=False`. Raises ValueError."""
        given_roots = [r if _is_url(r) else os.path.abspath(r) for r in roots]
        default_root = os.path.dirname(os.path.abspath(os.fspath(queue_dir)))
        return cls(
            allowed_factories=(*allow, *(entry_point_factories() if entry_points else ())),
            roots=tuple(given_roots or [default_root]),
            pythonpath_roots=tuple(os.path.abspath(p) for p in pythonpath_roots),
            allow_unsigned=allow_unsigned,
        )

    # -- checks ------------------------------------------------------------------------------------------
    def check(self, request: PublishRequest, *, file_id: str | None = None) -> None:
        """Raise PublishError if `request` names code or paths outside this policy (nothing is imported)."""
        if file_id is not None and request.request_id != file_id:
            raise PublishError(
                f"the request's body names id {request.request_id!r} but its file is {file_id!r}.json"
            )
        for what, name in (("factory", request.model.factory), ("config_type", request.model.config_type)):
            if name is not None and not self.allows_name(name):
                raise PublishError(
                    f"{what} {name!r} is not allowed by this publisher "
                    "(its operator allows it with --allow-factory)"
                )
        for entry in request.model.pythonpath:
            if not self._pythonpath_ok(entry):
                raise PublishError(
                    f"pythonpath entry {entry!r} is outside the directories this publisher allows "
                    "(--allow-pythonpath)"
                )
        paths = [("anchor_root", request.anchor_root), ("artifact_dir", request.artifact_dir)]
        if request.run_dir is not None:
            paths.append(("run_dir", request.run_dir))
        for what, path in paths:
            if not self._path_ok(path, url_ok=what == "anchor_root"):
                raise PublishError(
                    f"{what} {path!r} is outside this publisher's roots ({', '.join(self.roots)}; --root)"
                )

    def allows_name(self, name: str) -> bool:
        """Whether the import path `module:attribute` matches an entry (by name; `check_resolved` then
        checks what a wildcard entry resolved to)."""
        module, _, attribute = name.partition(":")
        for entry in self.allowed_factories:
            if entry == name:
                return True
            if entry.endswith(".*"):
                package = entry[:-2]
                in_package = module == package or module.startswith(package + ".")
                if in_package and not any(part.startswith("_") for part in attribute.split(".")):
                    return True
        return False

    def check_resolved(self, name: str, obj: Any) -> None:
        """After import: an object reached through a wildcard entry must be defined in that package (so
        `pkg.mod:os.system` or a re-exported `from os import system` is refused). Raises PublishError."""
        if name in self.allowed_factories:
            return
        defined_in = getattr(obj, "__module__", None)
        if isinstance(obj, types.ModuleType) or not isinstance(defined_in, str):
            raise PublishError(f"{name!r} is not a callable defined in an allowed package")
        for entry in self.allowed_factories:
            if entry.endswith(".*"):
                package = entry[:-2]
                if defined_in == package or defined_in.startswith(package + "."):
                    return
        raise PublishError(f"{name!r} is defined in {defined_in!r}, which no --allow-factory entry allows")

    def _pythonpath_ok(self, entry: str) -> bool:
        if not os.path.isabs(entry):
            return False
        import sys

        on_path = {os.path.realpath(p or os.getcwd()) for p in sys.path}
        if os.path.realpath(entry) in on_path:
            return True
        return _inside(entry, [Path(os.path.realpath(r)) for r in self.pythonpath_roots])

    def _path_ok(self, path: str, *, url_ok: bool) -> bool:
        if _is_url(path):
            return url_ok and _url_inside(path, [r for r in self.roots if _is_url(r)])
        if not os.path.isabs(path) or "\0" in path:
            return False
        local_roots = [Path(os.path.realpath(r)) for r in self.roots if not _is_url(r)]
        return _inside(path, local_roots)
