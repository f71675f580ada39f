"""Learning which inputs are dynamic from recompiles, and marking them dynamic up front next time.

A job whose batches vary in shape compiles once per new shape until Dynamo's automatic dynamic shapes
mark the varying dimension dynamic (one recompile). What was learned lives in the PGO profile of the
process and in the guard-failure reasons; this module turns both into `TORCH_COMPILE_DYNAMIC_SOURCES`
entries (`L['x']:0`), keeps them per job (`<run_dir>/compile/dynamic.json`) and per store entry, and
applies them through `torch.compiler.config.dynamic_sources` before the next attempt compiles, so that
attempt compiles dynamically at once and never recompiles for shape.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr import torch_compat
from ettr.atomic import atomic_write
from ettr.errors import unreadable
from ettr.untrusted import make_dirs_below, read_json_file

logger = logging.getLogger("ettr")

SCHEMA = "ettr.compile-dynamic/1"
FILENAME = "dynamic.json"
MAX_FILE_BYTES = 4 << 20
"""Larger than what `save` writes (its sources and at most 200 recompile reasons): a larger file is not ours."""

_SIZE_MISMATCH = re.compile(r"tensor '(?P<name>.+?)' size mismatch at index (?P<dim>\d+)")
_IDENT = re.compile(r"(?P<head>[A-Za-z_]\w*)(?P<rest>.*)$")
_ENTRY = re.compile(r"^(?P<source>.+?)(?::(?P<dim>\d+))?$")
_PLAIN_SOURCE = re.compile(r"[\w\[\]'.-]+")
MAX_SOURCE_CHARS = 1000


def plain_source(source: str) -> bool:
    """Whether `source` may be added to `dynamic_sources`: a Dynamo source name (`L['x']`,
    `L['self']._modules['fc']._parameters['weight']`): word characters, brackets, quotes, dots and minus
    signs only. Dynamo matches every entry as a regular expression too (`re.match`), and learned entries
    come from files others may write: a forged `(` made every compilation raise (Dynamo's
    `InternalTorchDynamoError: missing ), unterminated subpattern`, every attempt of the job), a nested
    quantifier can backtrack for ever, a comma splits one entry into several, and a backquote would run
    in the shell that pastes the line `ettr compile-report` prints."""
    if len(source) > MAX_SOURCE_CHARS or not _PLAIN_SOURCE.fullmatch(source):
        return False
    try:
        re.compile(source)  # an unbalanced bracket (`L['x'`)
    except re.error:
        return False
    return True


@dataclass(frozen=True, order=True)
class DynamicSource:
    """One `dynamic_sources` entry: a Dynamo source name, and the dimension (None: all of them)."""

    source: str
    dim: int | None = None

    def render(self) -> str:
        return self.source if self.dim is None else f"{self.source}:{self.dim}"

    @classmethod
    def parse(cls, text: str) -> DynamicSource:
        """Inverse of `render` (`L['x']:0` -> source `L['x']`, dim 0)."""
        match = _ENTRY.match(text.strip())
        if match is None or not plain_source(match["source"]):
            raise ValueError(f"not a dynamic source entry: {text!r}")
        dim = match["dim"]
        return cls(match["source"], None if dim is None else int(dim))


def _guard_name_to_source(name: str) -> str | None:
    # Guard messages name a frame local without Dynamo's wrapper: "x", "args[0]", "self.w" -> L['x']...
    if name.startswith(("L[", "G[")):
        return name
    match = _IDENT.match(name)
    if match is None:
        return None
    return f"L['{match['head']}']{match['rest']}"


def from_reason(reason: str) -> list[DynamicSource]:
    """Sources a guard-failure reason says changed size (`tensor 'x' size mismatch at index 0`)."""
    found = []
    for match in _SIZE_MISMATCH.finditer(reason):
        source = _guard_name_to_source(match["name"])
        if source is not None:
            found.append(DynamicSource(source, int(match["dim"])))
    return found


def from_pgo() -> list[DynamicSource]:
    """Sources this process's PGO profile has marked automatically dynamic (empty if Dynamo's profile
    is unavailable; it is internal to torch and may move)."""
    try:
        state, auto_dynamic = torch_compat.pgo_profile()
        if not state:
            return []
        found: list[DynamicSource] = []
        for code_state in state.values():
            for source, entry in code_state.automatic_dynamic.items():
                size = entry.size
                if isinstance(size, tuple):
                    found.extend(
                        DynamicSource(source, dim) for dim, s in enumerate(size) if s is auto_dynamic
                    )
                elif entry.scalar is auto_dynamic:
                    # A scalar profile has size and stride auto_dynamic whatever its value: only its
                    # scalar field says whether the value itself varied (as in pgo._collect_dynamic_sources).
                    found.append(DynamicSource(source))
        return found
    except Exception as exc:
        logger.debug("ettr: cannot read the PGO profile: %s", exc)
        return []


def merge(*groups: Iterable[DynamicSource]) -> tuple[DynamicSource, ...]:
    """Union of the groups, sorted; an all-dimensions entry makes per-dimension ones of its source moot."""
    every = {s for group in groups for s in group}
    whole = {s.source for s in every if s.dim is None}
    return tuple(sorted(s for s in every if s.dim is None or s.source not in whole))


def render(sources: Iterable[DynamicSource]) -> str:
    """The `TORCH_COMPILE_DYNAMIC_SOURCES` value for `sources`."""
    return ",".join(s.render() for s in sources)


def parse_many(values: Iterable[str]) -> tuple[DynamicSource, ...]:
    """Parse rendered entries, skipping malformed ones (they come from files others may edit)."""
    parsed = []
    for value in values:
        try:
            parsed.append(DynamicSource.parse(str(value)))
        except ValueError:
            logger.debug("ettr: skipping malformed dynamic source %r", value)
    return merge(parsed)


def apply(sources: Sequence[DynamicSource]) -> str:
    """Add `sources` to `torch.compiler.config.dynamic_sources`, keeping whatever the user set (their
    entries may be regexes, kept verbatim). Returns the new value. Takes effect for frames compiled
    from now on."""
    import torch

    current = [e.strip() for e in torch.compiler.config.dynamic_sources.split(",") if e.strip()]
    for source in sources:
        if not plain_source(source.source):  # a profile's odd name, or a file's forgery: not learned
            continue
        if source.render() not in current:
            current.append(source.render())
    value = ",".join(current)
    torch.compiler.config.dynamic_sources = value
    return value


def job_file(run_dir: str | os.PathLike[str]) -> Path:
    """Where a job keeps what it learned (shared by all its attempts)."""
    return Path(run_dir) / "compile" / FILENAME


def load(path: str | os.PathLike[str]) -> tuple[tuple[DynamicSource, ...], list[dict[str, Any]]]:
    """(sources, recompile reasons) kept at `path`; empty when missing or unreadable (never raises: a run
    directory's file may be forged, nested past the recursion limit, huge, a FIFO or a symlink)."""
    sources, reasons, _error = read(path)
    return sources, reasons


def read(path: str | os.PathLike[str]) -> tuple[tuple[DynamicSource, ...], list[dict[str, Any]], str | None]:
    """`load`, and why the file could not be read (None when it was, or when there is none: nothing was
    learned). A report says an unreadable file as such: nothing learned and unknown are not the same."""
    try:
        payload = read_json_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return (), [], None
    except (OSError, ValueError, RecursionError) as exc:
        return (), [], unreadable(path, exc)
    if not isinstance(payload, Mapping) or payload.get("schema") != SCHEMA:
        return (), [], f"{path} could not be read (not an {SCHEMA} file)"
    sources, reasons = payload.get("sources", []), payload.get("reasons", [])
    if not isinstance(sources, list) or not isinstance(reasons, list):  # a string's letters are no sources
        return (), [], f"{path} could not be read (its sources or reasons are not lists)"
    return parse_many(sources), [dict(r) for r in reasons if isinstance(r, Mapping)], None


def save(
    path: str | os.PathLike[str],
    sources: Iterable[DynamicSource],
    reasons: Iterable[Mapping[str, Any]] = (),
    *,
    max_reasons: int = 200,
) -> tuple[DynamicSource, ...]:
    """Merge `sources` and `reasons` into the file at `path` (atomically: temporary file, rename).
    Returns the merged sources."""
    target = Path(path)
    old_sources, old_reasons = load(target)
    merged = merge(old_sources, sources)
    all_reasons = [*old_reasons, *(dict(r) for r in reasons)][-max_reasons:]
    payload = {
        "schema": SCHEMA,
        "sources": [s.render() for s in merged],
        "env": render(merged),
        "reasons": all_reasons,
        "updated_ts": time.time(),
    }
    make_dirs_below(target.parent.parent, target.parent)  # RUN_DIR/compile, never a symlink there
    atomic_write(target, json.dumps(payload, indent=1))
    return merged
