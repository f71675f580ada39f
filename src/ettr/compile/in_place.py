"""The versions of a store entry a restore left in place, and whether a later restore may count them.

A compile store keeps one version of a key's entry (its latest manifest), and a save by another job of the same
key replaces it with files of the same names whose bytes, and often sizes, differ: inductor's cache files embed
the saving job's paths. A process that restored a complete version into its directories and restores again
later (a parked spare's restore ahead, `ettr.compile.ahead`, then its session's after the promotion) would
then copy the newer version over the one in place (the 156 MB precompiled header, 0.3-0.4 s on the in-place
recovery's critical path), though what is in place is a complete version of the same key.

`InPlace` is what the first restore made present: each artifact's files as its entry version lists them, the
entry versions themselves (their metadata go with them), and each file's identity as the restore left it
(device, inode, size, modification and status-change times, taken under the node's restore lock). `usable`
says whether a later restore into the same directories may take that version instead of the store's latest:
only when every file is still there with the identity it had (any write, in place or by rename, changes a
file's status-change time or its inode; a removed one is gone), so nothing is trusted that the first restore
did not check (each file it wrote was checked against its SHA-256 as it was copied, each it found present by
its size, as any restore does). What a later version added that the one in place lacks (kernels of another
model under the same key) is not copied: the process compiles what it needs and saves it, as it would have
had the other job's save come just after its restore.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ettr.compile import artifacts
from ettr.compile.store import StoredFile, StoreEntry

FileId = tuple[int, int, int, int, int]
"""A file's identity as `os.lstat` gives it: (device, inode, size, mtime in ns, ctime in ns)."""


def file_id(path: Path) -> FileId:
    """`path`'s identity (raises OSError when it is not there)."""
    st = os.lstat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def identify(files: Mapping[str, StoredFile], dest: Path) -> dict[str, FileId] | None:
    """Each file of an artifact restored into `dest`, identified as it is now; None when one is missing or
    not the size its version lists (then the version is not in place)."""
    found: dict[str, FileId] = {}
    for rel, stored in files.items():
        try:
            ident = file_id(dest / rel)
        except OSError:
            return None
        if ident[2] != stored.size:
            return None
        found[rel] = ident
    return found


@dataclass(frozen=True, kw_only=True)
class InPlace:
    """The entry versions a complete restore made present in its directories (see the module docstring)."""

    entry: StoreEntry
    """The workload's entry, as that restore read it (its files and metadata)."""
    headers: StoreEntry | None
    """The build's precompiled-header entry it restored from, if any."""
    trees: Mapping[str, Mapping[str, StoredFile]]
    """Artifact name -> the files it made present (the header variants it chose, for the headers)."""
    targets: Mapping[str, Path]
    """Artifact name -> the directory it restored into."""
    ids: Mapping[str, Mapping[str, FileId]]
    """Artifact name -> relative path -> the file's identity right after that restore."""

    def saved_again(
        self,
        name: str,
        entry: StoreEntry | None,
        headers: StoreEntry | None,
        files: Mapping[str, StoredFile],
    ) -> bool:
        """Whether artifact `name` was in place here and its entry's version in the store (`entry`, the workload's,
        or `headers`, the build's) is another one since, whose `files` (those this process would restore)
        differ from the ones in place."""
        if name not in self.trees:
            return False
        now, then = (headers, self.headers) if name == artifacts.HEADERS_ARCHIVE else (entry, self.entry)
        return now != then and files != self.trees[name]

    def usable(self, name: str, target: Path, wanted: Mapping[str, StoredFile]) -> str | None:
        """None when artifact `name`, as it is in place, may stand for `wanted` (the store's latest files for
        `target`, the header variants this process will use for the headers); else why not, in words."""
        if name not in self.trees or name not in self.ids:
            return f"{name}: not restored then"
        if self.targets.get(name) != target:
            return f"{name}: restored into another directory"
        if name == artifacts.HEADERS_ARCHIVE:
            variants = {artifacts.header_variant(rel) for rel in self.trees[name]}
            missing = {artifacts.header_variant(rel) for rel in wanted} - variants
            if missing:
                return f"{name}: a header variant it lacks is wanted ({sorted(missing)[0]})"
        changed = _changed(self.ids[name], target)
        return f"{name}: {changed}" if changed else None


def _changed(ids: Mapping[str, FileId], dest: Path) -> str | None:
    """None when every file is in `dest` with the identity it had; else what changed, in words."""
    num_changed, example = 0, ""
    for rel, ident in ids.items():
        try:
            now = file_id(dest / rel)
        except OSError:
            now = None
        if now != ident:
            num_changed += 1
            example = example or rel
    if num_changed:
        return f"{num_changed} of its {len(ids)} files changed or removed since (e.g. {example})"
    return None
