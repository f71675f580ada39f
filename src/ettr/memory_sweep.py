"""Memory copies that nobody will restore from, found and removed by the next ettr process on the node.

`ettr run` removes its job's copies when the job ends, and a checkpoint manager removes its rank's when the
job completes; copies of jobs that ended otherwise (a plain `torchrun` job killed, a SIGKILLed supervisor)
stayed in shared memory for good. So every process that keeps copies leaves a lease in their directory,
`lease-<pid>-<start ticks>`: the boot it runs in and its keepers, the processes whose life keeps the copy
useful (itself; its `ettr run` supervisor, which restarts it; its torchrun agent, which may restart it).

`sweep` (at each `ettr run` start and each checkpoint manager that keeps memory copies) removes a
directory of copies when

- it has leases, every one readable, no keeper of any runs in this boot (`ettr.procs.pid_alive`: same pid
  and start ticks), and nothing in it changed for `orphan_grace_s` (10 minutes: the same job started again on
  this node soon after -- a user's or a scheduler's rerun of a plain torchrun job -- still restores from
  memory, as its copy is bound to the checkpoint's committed manifest); or
- it has no readable lease (an older ettr's, or unreadable) and nothing in it changed for
  `unowned_max_age_s`.

It also removes the in-place store directories (`inplace-<pid>-<hex>`) of `ettr run` supervisors that are
gone. A live job's copy is never removed: a keeper that runs keeps it, a pid whose start ticks cannot be read
counts as running, and an unreadable lease as unknown. Removing a copy is never unsafe either: a copy is a
cache of a committed checkpoint (a restore without one reads storage). The sweep never follows a symlink,
touches nothing but `ckpt-*` and `inplace-*` directories of the private memory root, looks at no more than
`max_entries` of them, and never raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.procs import pid_alive, start_ticks
from ettr.run_env import MEMORY_OWNER_NAME, SUPERVISOR_PID_ENV, memory_root
from ettr.untrusted import read_json_file, whole_number

logger = logging.getLogger("ettr")

LEASE_PREFIX = "lease-"
LEASE_SCHEMA = "ettr.memory-lease/1"
MAX_LEASE_BYTES = 4096
MAX_KEEPERS = 8
DEFAULT_UNOWNED_MAX_AGE_S = 3600.0
"""A directory of copies without a readable lease is removed once nothing in it changed for this long."""
DEFAULT_ORPHAN_GRACE_S = 600.0
"""A directory of copies whose keepers are all gone is removed once nothing in it changed for this long."""
DEFAULT_MAX_ENTRIES = 4096
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_INPLACE_DIR = re.compile(r"inplace-(\d{1,10})-[0-9a-f]{1,64}")

Alive = Callable[[int, int | None], bool]


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say): a pid of another boot names no process of this one."""
    try:
        return BOOT_ID_PATH.read_text(encoding="ascii").strip()[:64]
    except (OSError, UnicodeDecodeError):
        return ""


def keepers_of_this_process(environ: Mapping[str, str] | None = None) -> list[tuple[int, int | None]]:
    """This process, its `ettr run` supervisor and its torchrun agent (the parent of a torchrun worker):
    (pid, start ticks) each."""
    environ = os.environ if environ is None else environ
    pids = [os.getpid()]
    supervisor = whole_number(environ.get(SUPERVISOR_PID_ENV, "").strip())
    if supervisor is not None:
        pids.append(supervisor)
    if environ.get("TORCHELASTIC_RUN_ID"):  # a worker of torchrun's agent, which restarts its workers
        pids.append(os.getppid())
    unique = list(dict.fromkeys(p for p in pids if p > 1))
    return [(pid, start_ticks(pid)) for pid in unique]


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Who keeps a directory of memory copies alive."""

    boot_id: str
    keepers: tuple[tuple[int, int | None], ...]

    def to_json(self) -> str:
        return json.dumps({"schema": LEASE_SCHEMA, "boot_id": self.boot_id, "keepers": self.keepers})

    @classmethod
    def parse(cls, data: object) -> Lease:
        """Raises ValueError for anything but a lease of this schema with sane pids."""
        if not isinstance(data, dict) or data.get("schema") != LEASE_SCHEMA:
            raise ValueError("not a memory-copy lease")
        boot, keepers = data.get("boot_id"), data.get("keepers")
        if not isinstance(boot, str) or len(boot) > 64 or not isinstance(keepers, list):
            raise ValueError("malformed lease")
        if not keepers or len(keepers) > MAX_KEEPERS:
            raise ValueError("a lease names no keeper, or too many")
        parsed = []
        for keeper in keepers:
            if not isinstance(keeper, list) or len(keeper) != 2:
                raise ValueError("malformed keeper")
            pid, ticks = keeper
            if type(pid) is not int or not 1 < pid < 1 << 31:
                raise ValueError("a keeper's pid is out of range")
            if ticks is not None and (type(ticks) is not int or not 0 <= ticks < 1 << 63):
                raise ValueError("a keeper's start ticks are out of range")
            parsed.append((pid, ticks))
        return cls(boot_id=boot, keepers=tuple(parsed))

    def held(self, current_boot: str, alive: Alive) -> bool:
        """Whether a keeper still runs (a lease of another boot is held by nobody)."""
        if self.boot_id and current_boot and self.boot_id != current_boot:
            return False
        return any(alive(pid, ticks) for pid, ticks in self.keepers)

    def covered_by(self, other: Lease, alive: Alive) -> bool:
        """Whether this lease keeps nothing `other` does not: of the same boot, and each of its keepers that
        still runs is one of `other`'s (a dead rank's lease beside its replacement's, both naming the same
        `ettr run` supervisor)."""
        return self.boot_id == other.boot_id and all(
            keeper in other.keepers or not alive(*keeper) for keeper in self.keepers
        )


def lease_name(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{LEASE_PREFIX}{pid}-{start_ticks(pid) or 0}"


def write_lease(
    directory: Path, environ: Mapping[str, str] | None = None, *, alive: Alive = pid_alive
) -> None:
    """Leave this process's lease in `directory` (replaced whole); the leases this one makes redundant are
    removed: those no keeper of which runs, and those whose keepers that still run are all this lease's too.
    The supervisor keeps every rank's lease held while it lives, so without the second rule each process
    of a long job's restarts left its lease behind (a soak: 9 leases after 7 restarts of 2 ranks, one more
    per replaced rank until the job's end). Raises OSError."""
    lease = Lease(boot_id=boot_id(), keepers=tuple(keepers_of_this_process(environ)))
    path = directory / lease_name()
    atomic_write(path, lease.to_json(), mode=0o600, durable=False)  # shared memory: nothing to fsync
    current = lease.boot_id
    for other in _lease_paths(directory):
        if other != path:
            with contextlib.suppress(OSError, ValueError):
                found = _read_lease(other)
                if not found.held(current, alive) or found.covered_by(lease, alive):
                    os.unlink(other)


def remove_lease(directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(directory / lease_name())


def is_lease_name(name: str) -> bool:
    return name.startswith(LEASE_PREFIX) or (name.startswith(f".{LEASE_PREFIX}") and name.endswith(".tmp"))


def _lease_paths(directory: Path) -> list[Path]:
    with os.scandir(directory) as entries:
        return [Path(e.path) for e in entries if e.name.startswith(LEASE_PREFIX)]


def _read_lease(path: Path) -> Lease:
    return Lease.parse(read_json_file(path, MAX_LEASE_BYTES))


def _newest_mtime(directory: Path) -> float:
    newest = os.lstat(directory).st_mtime
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def why_removable(
    directory: Path,
    *,
    now: float,
    current_boot: str,
    alive: Alive,
    unowned_max_age_s: float,
    orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S,
) -> str:
    """Why nobody will restore from the copies in `directory` ("" when someone may). Raises OSError."""
    inplace = _INPLACE_DIR.fullmatch(directory.name)
    if inplace:  # an `ettr run` supervisor's in-place store; its workers do not outlive it (JobGuard)
        pid = int(inplace.group(1))
        return "" if alive(pid, None) else f"its supervisor (pid {pid}) is gone"
    leases, unknown = [], 0
    for path in _lease_paths(directory):
        try:
            leases.append(_read_lease(path))
        except (OSError, ValueError):
            unknown += 1
    if any(lease.held(current_boot, alive) for lease in leases):
        return ""
    if leases and not unknown and all(lease.boot_id and lease.boot_id != current_boot for lease in leases):
        return "it was kept by processes of an earlier boot"
    age_s = now - _newest_mtime(directory)
    if leases and not unknown:
        if age_s > orphan_grace_s:
            return f"every process that kept it is gone, and it is unchanged for {age_s:.0f} s"
        return ""
    if age_s > unowned_max_age_s:
        return f"no process holds it and it is unchanged for {age_s:.0f} s"
    return ""


def sweep(
    root: Path | None = None,
    *,
    now: float | None = None,
    current_boot: str | None = None,
    alive: Alive = pid_alive,
    unowned_max_age_s: float = DEFAULT_UNOWNED_MAX_AGE_S,
    orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> list[Path]:
    """Remove the directories of memory copies under `root` (default: `ettr.run_env.memory_root()`) that
    nobody will restore from (the module's rules); returns what was removed. Never raises."""
    try:
        root = memory_root() if root is None else root
        if root is None:
            return []
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            return []  # not ours (or a symlink): nothing in it is ours to remove
        now = time.time() if now is None else now
        current_boot = boot_id() if current_boot is None else current_boot
        return _sweep(root, now, current_boot, alive, unowned_max_age_s, orphan_grace_s, max_entries)
    except Exception as exc:  # noqa: BLE001 - a clean-up never stops a job or a save
        logger.debug("ettr: memory-copy sweep of %s skipped (%s)", root, exc)
        return []


def _sweep(
    root: Path,
    now: float,
    current_boot: str,
    alive: Alive,
    unowned_max_age_s: float,
    orphan_grace_s: float,
    max_entries: int,
) -> list[Path]:
    removed = []
    for directory in _candidates(root, max_entries):
        try:
            why = why_removable(
                directory,
                now=now,
                current_boot=current_boot,
                alive=alive,
                unowned_max_age_s=unowned_max_age_s,
                orphan_grace_s=orphan_grace_s,
            )
            if not why:
                continue
            shutil.rmtree(directory)
        except OSError:
            continue
        removed.append(directory)
        logger.info("ettr: removed memory copies %s (%s)", directory, why)
    return removed


def _candidates(root: Path, max_entries: int) -> list[Path]:
    found = []
    with os.scandir(root) as entries:
        for seen, entry in enumerate(entries):
            if seen >= max_entries:
                break
            if entry.name.startswith(("ckpt-", "inplace-")) and entry.is_dir(follow_symlinks=False):
                found.append(Path(entry.path))
    return found


def another_keeper_runs(directory: Path, *, alive: Alive = pid_alive) -> bool:
    """Whether a lease in `directory` other than this process's names a process (the lease's own: its
    name's pid and start ticks) that still runs: a rank that may be about to write its copy."""
    own = lease_name()
    for path in _lease_paths(directory):
        if path.name == own:
            continue
        pid_text, _, ticks_text = path.name[len(LEASE_PREFIX) :].partition("-")
        pid, ticks = whole_number(pid_text), whole_number(ticks_text)
        if pid is None or ticks is None:
            continue
        if alive(pid, ticks or None):
            return True
    return False


def only_bookkeeping_left(directory: Path) -> bool:
    """Whether `directory` holds nothing but its owner file and leases (no copy is left in it)."""
    with os.scandir(directory) as entries:
        return all(e.name == MEMORY_OWNER_NAME or is_lease_name(e.name) for e in entries)
