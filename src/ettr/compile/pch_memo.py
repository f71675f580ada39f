"""Inductor's precompiled-header lookup, remembered in inductor's cache directory.

Before a C++ kernel's cache lookup, inductor asks `codecache._precompile_header(header, cmd_line, ...)` for
the precompiled header it would compile with, whether or not anything will compile: that preprocesses the
header (`g++ -E` of `torch/csrc/inductor/cpp_prefix.h` and all it includes, then `openssl sha512` of the
output) to name the header file after its content, and builds it if it is missing. A process whose kernels
all come from the cache (every attempt after the first, or a job whose compile store restored them) pays
the preprocessing for nothing (`g++ -E` alone: 0.36 s, 0.14 s of CPU, on an idle core here). `share`
wraps the lookup so that

* its answer (the header's path, relative to inductor's header directory) is remembered in inductor's cache
  directory (`MEMO_NAME`, written whole), with what the preprocessing reads beside the call's arguments
  (`memo_key`: the compiler and its version, torch and its libtorch, the header's own file, the include
  paths from the environment); a later process whose call and key are the same to the letter, and which has
  that header and its compiled form (`.gch`) in its header directory, takes the path instead of
  preprocessing. The compile store carries the file with the rest of the cache directory, and the header
  with the build's precompiled headers. It is data, never run: a header's name as inductor makes one
  (`HEADER_NAME`: `<hash>.h` directly in the header directory), of a file that must exist with its `.gch`;
  anything else, and the lookup runs as before;
* concurrent callers share one answer per call (inductor caches it with `functools.cache`, which holds no
  lock), and `cache_info` counts remembered answers too, so that the compile store still sees that the
  process used a precompiled header (`torch_compat.inductor_used_precompiled_header`).

A header changed in place under the same torch version, libtorch file and header file is the one thing the
key cannot see; `ETTR_COMPILE_PCH_MEMO=0` turns the memo off.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ettr import torch_compat
from ettr.atomic import atomic_write
from ettr.patcher import Patcher
from ettr.run_env import COMPILE_PCH_MEMO_ENV
from ettr.untrusted import read_json_file

logger = logging.getLogger("ettr")

_answered: set[str] = set()
"""The headers (relative to inductor's header directory) this process's lookups answered: the variants it
uses, which its save stores and keeps in use (`used_headers`)."""
_answered_lock = threading.Lock()

MEMO_NAME = "ettr-pch.json"
"""The remembered answers, in inductor's cache directory."""
MEMO_SCHEMA = "ettr.pch/1"
MEMO_MAX_BYTES = 256 * 1024
MAX_ENTRIES = 32
MEMO_ENV = COMPILE_PCH_MEMO_ENV
"""`ETTR_COMPILE_PCH_MEMO=0` turns the memo off."""
_INCLUDE_ENV = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")
"""The environment the preprocessor reads (include search paths, where it finds its own parts)."""

Lookup = Callable[..., str]
Where = Callable[[], "tuple[Path, Path] | None"]
"""The memo's directory (inductor's cache directory) and inductor's header directory, looked up when the
lookup runs; None: nowhere to remember."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(MEMO_ENV, "1") != "0"


def share(patcher: Patcher, where: Where | None = None) -> bool:
    """Wrap inductor's lookup (see the module docstring); whether it is wrapped now (False: turned off, or
    inductor moved it). Imports inductor's codecache."""
    if not enabled():
        return False
    try:
        module = torch_compat.inductor_codecache_module()
    except ImportError as exc:
        logger.debug("ettr: inductor's precompiled-header lookup not remembered (%s)", exc)
        return False
    if not callable(getattr(module, "_precompile_header", None)):
        return False
    return patcher.wrap(module, "_precompile_header", lambda lookup: remembered(lookup, where or _where))


def remembered(
    lookup: Lookup, where: Where, key: Callable[[str], dict[str, str] | None] | None = None
) -> Lookup:
    """`lookup` (inductor's `_precompile_header`), its answers shared per call and remembered (see the
    module docstring). `key`: what an answer depends on beside the call (`memo_key` by default)."""
    lock = threading.RLock()
    answers: dict[str, str] = {}
    make_key = key or memo_key

    def precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        call = json.dumps(
            [header, hashable_cmd_line, sorted((k, _stable(v)) for k, v in compile_command.items())]
        )
        with lock:
            if call not in answers:
                answers[call] = _recall_or_look_up(
                    lambda: lookup(header, hashable_cmd_line, **compile_command),
                    call,
                    header,
                    where,
                    make_key,
                )
            return answers[call]

    def cache_info() -> Any:
        info = lookup.cache_info()  # type: ignore[attr-defined]
        return info._replace(currsize=max(info.currsize, len(answers)))

    def cache_clear() -> None:
        with lock:
            answers.clear()
        lookup.cache_clear()  # type: ignore[attr-defined]

    if hasattr(lookup, "cache_info"):
        precompile_header.cache_info = cache_info  # type: ignore[attr-defined]
        precompile_header.cache_clear = cache_clear  # type: ignore[attr-defined]
    return precompile_header


def _stable(value: Any) -> str:
    """`value` as the same text in every process: a plain value's repr, else its type and `str` (inductor's
    vector ISA, whose repr names a function's address)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_stable(v) for v in value)})"
    return f"{type(value).__module__}.{type(value).__qualname__}:{value}"


def _recall_or_look_up(
    run: Callable[[], str],
    call: str,
    header: str,
    where: Where,
    make_key: Callable[[str], dict[str, str] | None],
) -> str:
    try:
        dirs, key = where(), make_key(header)
    except Exception as exc:
        logger.debug("ettr: inductor's precompiled header not remembered (%s)", exc)
        dirs, key = None, None
    if dirs is None or key is None:
        return run()
    memo_path, header_dir = dirs[0] / MEMO_NAME, dirs[1]
    entries = _entries(memo_path)
    for entry in entries:
        if entry.get("call") == call and entry.get("key") == key:
            found = _inside(header_dir, entry.get("header"))
            if found is not None and os.path.isfile(found) and os.path.isfile(found + ".gch"):
                _answer(str(entry["header"]))
                return found
    path = run()
    relative = os.path.relpath(path, header_dir)
    if _inside(header_dir, relative) is not None and os.path.isfile(path + ".gch"):
        _answer(relative)
        kept = [e for e in entries if e.get("call") != call][-(MAX_ENTRIES - 1) :]
        _write(memo_path, [*kept, {"call": call, "key": key, "header": relative}])
    return path


def _answer(relative: str) -> None:
    with _answered_lock:
        _answered.add(relative)


def used_headers() -> frozenset[str]:
    """The precompiled headers this process's inductor was given (relative to its header directory, e.g.
    `c6oq...qj7.h`; its compiled form is that name + `.gch`); empty when none was, or the memo is off."""
    with _answered_lock:
        return frozenset(_answered)


def wanted_headers(cache_dir: Path, header_dir: Path) -> frozenset[str] | None:
    """The precompiled headers this process's inductor will look up, as far as the memo in `cache_dir`
    knows: the headers of the remembered answers whose key (`memo_key`) is this process's to the letter,
    i.e. the answers a lookup of this process takes instead of preprocessing. None when that is unknown
    (memo off or absent, no answer of this build): then every stored variant is wanted. Read as data: a
    name that is not a plain header file name inside `header_dir` is ignored. Imports inductor."""
    if not enabled():
        return None
    keys: dict[str, dict[str, str] | None] = {}
    wanted: set[str] = set()
    for entry in _entries(cache_dir / MEMO_NAME):
        try:
            header = json.loads(entry["call"])[0]
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        relative = entry.get("header")
        if not isinstance(header, str) or _inside(header_dir, relative) is None:
            continue
        if header not in keys:
            try:
                keys[header] = memo_key(header)
            except Exception as exc:  # inductor moved what the key reads: unknown
                logger.debug("ettr: precompiled-header key unknown (%s)", exc)
                return None
        if keys[header] is not None and entry.get("key") == keys[header]:
            wanted.add(str(relative))
    return frozenset(wanted) if wanted else None


HEADER_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}\.h")
"""What inductor's lookup names a precompiled header: `<hash>.h` directly in its header directory (the
compiled form beside it is that name + `.gch`)."""


def _inside(header_dir: Path, relative: Any) -> str | None:
    """`header_dir / relative` when `relative` is a header's name as inductor makes one (`HEADER_NAME`):
    a memo is data someone else may have written, and its answer is what g++ is told to `-include`."""
    if not isinstance(relative, str) or not HEADER_NAME.fullmatch(relative):
        return None
    return str(header_dir / relative)


def _entries(path: Path) -> list[dict[str, Any]]:
    """The remembered answers at `path` ([] when there are none: missing, unreadable or malformed)."""
    try:
        memo = read_json_file(path, MEMO_MAX_BYTES)
    except (OSError, ValueError):
        return []
    if not isinstance(memo, dict) or memo.get("schema") != MEMO_SCHEMA:
        return []
    entries = memo.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        return []
    return [e for e in entries if isinstance(e, dict)]


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    try:
        memo = {"schema": MEMO_SCHEMA, "entries": entries}
        atomic_write(path, json.dumps(memo, sort_keys=True, indent=1), mode=0o600, durable=False)
    except Exception as exc:
        logger.debug("ettr: inductor's precompiled header not remembered (%s)", exc)


def memo_key(header: str) -> dict[str, str] | None:
    """What the header's preprocessing reads beside the call (`header` as inductor names it, under torch's
    include directory): the compiler and its version, torch's version, its libtorch and the header's own
    file (size, mtime), the include paths from the environment. None when the header is not torch's."""
    return torch_compat.inductor_header_memo_key(
        header, {name: os.environ.get(name, "") for name in _INCLUDE_ENV}
    )


def _where() -> tuple[Path, Path] | None:
    header_dir = torch_compat.inductor_header_dir()
    return None if header_dir is None else (Path(torch_compat.inductor_cache_dir()), Path(header_dir))
