"""A parked spare's compile start-up, done ahead: the compile store's restore before the promotion.

A spare (`ettr.bootstrap.spare`) runs the script's top level and parks before `ettr.resilient`'s first
rendezvous; without this, its compile session restores the store entry only at its first `torch.compile`
after the promotion (~150 MB: 0.49 s of the demo's 1.1 s in-place recovery). `start` (called by
`autoinstall.restore_ahead` at the park) restores it at once, on a thread of its own at the spare's priority
(nice 10 beside training) with the lowest best-effort I/O priority, into the directories the promoted process
will compile in as far as they can be known now: inductor's cache directory and its precompiled-header
directory as the environment the script's top level left names them. It also computes inductor's hash of
torch's sources (`codecache.torch_key`, the first compile's cache lookups need it: pure, of the installed
torch only), when inductor's codecache is already imported.

Nothing is booked: the restore's report is kept here (`Ahead.info`). After the promotion, the compile session
restores as always (`StoreRestorer.restore_once`) and asks `Ahead.settle` first, which waits for a restore
still running (its thread's priority given back) and says whether it was for the same entry (key digest, store
location) and directories: then the session's restore finds every file present (`already_present`: a few
stats, no copy), even where another job saved the entry again since (the version restored here, `Ahead.kept`,
counts while its files are as this restore left them: `in_place`; the MARK's `version` says which), and its
MARK carries `ahead` (the spare's restore: status, files, bytes, its own begin and duration); else (the script moved `TORCHINDUCTOR_CACHE_DIR` or `TMPDIR` after the rendezvous, or changed
inductor's configuration) `ahead.unused` says why, and the session's restore is the ordinary one, into the
directories of now. Correctness never rests on the ahead restore: the session's restore checks what is
present as for any restart on the same node, under the same node lock (`artifacts.restore_lock`), and every
file the ahead restore writes appears whole (`restore_tree`); a spare killed mid-restore leaves whole files
and temporaries, never a file of the right size with wrong bytes, and its flock ends with it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettr import torch_compat
from ettr.compile import artifacts, pch_memo
from ettr.compile.config import CompileConfig, default_user_key
from ettr.compile.in_place import InPlace
from ettr.compile.key import StoreKey, current_key
from ettr.compile.restore import EntryView, StoreRestorer
from ettr.compile.save import raise_save_thread
from ettr.compile.store import CompileStore, StoreConfig
from ettr.procs import lower_this_thread

logger = logging.getLogger("ettr")

_lock = threading.Lock()
_current: Ahead | None = None


@dataclass
class Ahead:
    """One ahead restore: where it went and what it did (`info`, once done)."""

    dirs: tuple[Path, Path]
    """(inductor's cache directory, the precompiled-header directory) it restored into."""
    location: str
    """The store, as configured."""
    began: float = field(default_factory=time.time)
    digest: str | None = None
    """The entry's key digest (computed on the thread; None until then or when that failed)."""
    info: dict[str, Any] | None = None
    """The restorer's report (status, files, bytes, duration), None while it runs."""
    torch_key_s: float | None = None
    """Seconds the hash of torch's sources took here (None: not computed ahead)."""
    done: threading.Event = field(default_factory=threading.Event)
    thread_id: int | None = None
    """The thread's native id."""
    settled: dict[str, Any] | None = None
    in_place: InPlace | None = None
    """The entry versions its restore made present, when it was complete (`StoreRestorer.in_place`)."""

    def run(
        self,
        config: CompileConfig,
        *,
        warm: bool,
        store: CompileStore | None = None,
        key: StoreKey | None = None,
    ) -> None:
        """The thread: restore, then hash torch's sources. `warm`: inductor's codecache is imported already
        (by the zygote's warm-up): only then is it used here (importing it fixes the header directory)."""
        self.thread_id = threading.get_native_id()
        lower_this_thread(
            nice_step=0
        )  # the spare's own nice value (10 beside training), the lowest I/O priority
        try:
            key = key or current_key(user_key=config.user_key or default_user_key())
            self.digest = key.digest
            opened = store or open_store(config)
            reports: list[dict[str, Any]] = []
            restorer = StoreRestorer(
                store=lambda: opened,
                key=lambda: key,
                view=EntryView(),
                mark=lambda _ts, data: reports.append(data),
                wanted_headers=pch_memo.wanted_headers if warm else None,
                remember=True,
            )
            restorer.restore_once(self.dirs)
            self.in_place = restorer.in_place
            self.info = reports[0] if reports else {"status": "none"}
        except Exception as exc:  # the session restores as always
            self.info = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            logger.debug("ettr: a spare's ahead restore failed (%s)", exc)
        finally:
            self.done.set()
        if warm:
            begin = time.time()
            try:
                from torch._inductor import codecache

                codecache.torch_key()
                self.torch_key_s = time.time() - begin
            except Exception as exc:
                logger.debug("ettr: inductor's torch_key not computed ahead (%s)", exc)

    def settle(self, dirs: tuple[Path, Path], digest: str, location: str | None) -> dict[str, Any]:
        """After the promotion, before the session's restore: wait for this restore (its thread raised to
        the caller's priority) and say what it was, for the session's MARK: {"ahead": {...}}. Once."""
        if self.settled is not None:
            return self.settled
        if not self.done.is_set() and self.thread_id is not None:
            _raise_to_caller(self.thread_id)  # the promoted process waits on it now
        self.done.wait()
        info = dict(self.info or {})
        said: dict[str, Any] = {
            "status": info.get("status"),
            "begin_ts": info.get("begin_ts", self.began),
            "duration_s": info.get("duration_s"),
            "num_files": info.get("num_files", 0),
            "loaded_bytes": info.get("loaded_bytes", 0),
        }
        if self.torch_key_s is not None:
            said["torch_key_s"] = round(self.torch_key_s, 4)
        why = _unused(self, dirs, digest, location)
        if why is not None:
            said["unused"] = why
        self.settled = {"ahead": said}
        return self.settled

    def kept(self) -> InPlace | None:
        """Once settled for the session's key, store and directories: what this restore left in place, for the
        session's restore to take where the store's entry was saved again since (`in_place`); else None."""
        if self.settled is None or "unused" in self.settled["ahead"]:
            return None
        return self.in_place


def _unused(ahead: Ahead, dirs: tuple[Path, Path], digest: str, location: str | None) -> str | None:
    if ahead.info is None or ahead.info.get("status") in ("error", "none"):
        return "it failed" if ahead.info else "it did not run"
    if location != ahead.location:
        return "another store"
    if digest != ahead.digest:
        return "another entry (inductor's configuration changed after the park)"
    if dirs[0] != ahead.dirs[0]:
        return "the inductor cache directory moved after the park"
    if dirs[1] != ahead.dirs[1]:
        return "the precompiled-header directory moved after the park"
    return None


def _raise_to_caller(tid: int) -> None:
    """Thread `tid` at the calling thread's nice value where it is nicer (the agent put the promoted spare's
    tasks back at 0 where it could; never lower it again to where it was lowered from)."""
    import os

    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if os.getpriority(os.PRIO_PROCESS, tid) > mine:
            raise_save_thread(tid, mine)
    except OSError:
        pass


def open_store(config: CompileConfig) -> CompileStore:
    """The store `config` names (`config.store` must be set): the compile session's, and a spare's ahead."""
    import os

    assert config.store is not None
    return CompileStore.open(
        StoreConfig(
            location=os.path.expanduser(config.store),
            max_bytes=config.max_store_bytes,
            secret=config.secret,
        )
    )


def start(
    config: CompileConfig,
    *,
    refix_headers: bool,
    store: CompileStore | None = None,
    key: StoreKey | None = None,
) -> bool:
    """In a parked spare whose cache directory is chosen (`autoinstall.restore_ahead`): start the ahead
    restore. `refix_headers`: inductor was imported by a warm-up, and the compile session will put its
    precompiled-header directory where a cold start's import would (`session._header_dir_as_a_cold_start`):
    so does this, now. `store` and `key`: the store and the key (default: `config`'s store, this process's
    key, as the session will use). Whether it started; never raises."""
    global _current
    if config.store is None or not config.restore:
        return False
    try:
        if refix_headers:
            torch_compat.inductor_refix_header_dir()
        dirs = (artifacts.inductor_cache_dir(), artifacts.headers_dir())
    except Exception as exc:
        logger.debug("ettr: no ahead restore (%s)", exc)
        return False
    ahead = Ahead(dirs=dirs, location=config.store)
    import sys

    warm = "torch._inductor.codecache" in sys.modules  # never imported here: that fixes a directory
    with _lock:
        if _current is not None:
            return False
        _current = ahead
    thread = threading.Thread(
        target=ahead.run,
        args=(config,),
        kwargs={"warm": warm, "store": store, "key": key},
        name="ettr-compile-ahead",
        daemon=True,
    )
    thread.start()
    return True


def current() -> Ahead | None:
    """The ahead restore of this process not yet taken, if any."""
    return _current


def take() -> Ahead | None:
    """The ahead restore of this process, once (the compile session's)."""
    global _current
    with _lock:
        ahead, _current = _current, None
    return ahead
