"""A process's compile session: restore before the first compile, record compiles, save once they settle.

`CompileSession` is the lifecycle of one process's compile support, over two parts of one concept each:

1. before Dynamo traces the first frame, it applies the dynamic sources learned by earlier attempts of
   this job (`<run_dir>/compile/dynamic.json`) and by earlier jobs (the store entry's metadata), sets
   `torch.compiler.config.job_id` so that PGO profiles are written, and restores the store entry
   (`restore.StoreRestorer`: inductor cache directory, precompiled headers, else the megacache archive),
   on a helper thread from the first `torch.compile` on (in a promoted spare, done ahead before the promotion
   where its directories did not move since: `ahead`, then only checked here), which then runs inductor's CPU vector-ISA probe
   ahead (in a process without an accelerator; `isa_probe` shares its answer and remembers it in inductor's
   cache directory, which the store carries);
2. it records every compilation as a COMPILE span and every recompile with its reason (`CompileHooks`),
   and at each recompile writes the dynamic sources learned so far to the run directory;
3. once no compilation has run for `settle_s`, a background thread saves the artifacts to the store
   (`save.StoreSaver`; again at exit if anything new was compiled since). The training thread never
   waits for a save.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ettr import torch_compat
from ettr.compile import artifacts, dynamic, isa_probe, lazy_templates, pch_memo
from ettr.compile.ahead import Ahead, open_store
from ettr.compile.config import CompileConfig, default_user_key, pgo_job_id
from ettr.compile.hooks import CompileHooks, CompileRecord
from ettr.compile.key import StoreKey, current_key
from ettr.compile.restore import STORE_MARK, EntryView, StoreRestorer
from ettr.compile.save import StoreSaver, lower_save_thread, raise_save_thread
from ettr.compile.store import CompileStore
from ettr.events import EventKind
from ettr.patcher import Patcher
from ettr.recorder import RecorderProtocol

logger = logging.getLogger("ettr")

__all__ = ["STORE_MARK", "CompileConfig", "CompileSession"]


class CompileSession:
    """Compile recording, restoring and saving for one process (see the module docstring).

    Args:
        rec: this process's recorder (`run_dir`, `rank`, `attempt`, `span`, `record`, `add_step_listener`).
        config: what to do.
        store: the store to use (default: opened from `config.store`); tests pass a fake-backed one.
        key: the store key (default: `current_key` of `config.user_key`, computed at first compile).
    """

    def __init__(
        self,
        rec: RecorderProtocol,
        config: CompileConfig,
        *,
        store: CompileStore | None = None,
        key: StoreKey | None = None,
        warm_imports: bool = False,
        ahead: Ahead | None = None,
    ) -> None:
        self.rec = rec
        self._ahead = ahead
        """The store's restore a parked spare did before its promotion (`ettr.compile.ahead`), if any."""
        self._warm_imports = warm_imports
        """Inductor was imported ahead by a warm process (a zygote's or standby's warm-up), before this
        process's script set its environment (`_on_torch_compile` puts right what the import fixed)."""
        self.config = config
        self.user_key = config.user_key or default_user_key()
        self._store = store
        self._key = key
        self.hooks = CompileHooks(rec, before_first_compile=self.prepare, after_compile=self._after_compile)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_nice: tuple[int, int] | None = None
        """The settle thread's (native id, nice value before it was lowered)."""
        self._closed = False
        self._prepared = False
        self._pending_marks: list[tuple[float, dict[str, Any]]] = []
        self._dirty = False
        self._started = False
        self._view = EntryView()
        self._patcher = Patcher()
        """Its patches of inductor (at the first torch.compile): `lazy_templates`, `isa_probe`."""
        parts: dict[str, Any] = {"store": lambda: self.store, "key": lambda: self.key, "view": self._view}
        self._pch_memo = False
        """Whether inductor's header lookup is remembered (`pch_memo.share`): then its memo names the header
        variants this process uses, and a restore copies only those."""
        self._restorer = StoreRestorer(
            mark=self._mark,
            wanted_headers=self._wanted_headers,
            before=self._settle_ahead if ahead is not None else None,
            earlier=ahead.kept if ahead is not None else None,
            **parts,
        )
        self._saver = StoreSaver(rec=rec, config=config, hooks=self.hooks, mark=self._mark, **parts)
        self.applied_sources: tuple[dynamic.DynamicSource, ...] = ()
        self.batch_spec: Mapping[str, Any] | None = None
        """A fast-batch spec to keep with the entry (set by `fast_start`)."""

    def _settle_ahead(self, dirs: tuple[Path, Path], digest: str) -> dict[str, Any]:
        # The spare's restore, waited for: the restore that follows finds its files present (same entry,
        # same directories) or, where they moved, restores into the directories of now; its MARK says which.
        assert self._ahead is not None
        return self._ahead.settle(dirs, digest, self.config.store)

    def _wanted_headers(self, cache_dir: Path, header_dir: Path) -> frozenset[str] | None:
        return pch_memo.wanted_headers(cache_dir, header_dir) if self._pch_memo else None

    @property
    def store_meta(self) -> dict[str, Any]:
        """Metadata of the restored store entry (learned sources, batch spec), empty if none."""
        return self._view.meta

    @property
    def last_restore(self) -> dict[str, Any] | None:
        return self._restorer.last_restore

    @property
    def last_save(self) -> dict[str, Any] | None:
        return self._saver.last_save

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Install the Dynamo hooks, the step listener and the exit save (imports `torch._dynamo`)."""
        if self._started:
            return
        self._started = True
        self.hooks.install()
        try:
            self.rec.add_step_listener(self._on_step)
        except Exception as exc:  # a recorder without listeners: the background thread emits instead
            logger.debug("ettr: no step listener: %s", exc)
        atexit.register(self.close)
        # `torch._dynamo` is imported by much that never compiles (DDP, for one): nothing more is done (the
        # store is not even looked up) until the program calls `torch.compile` (or compiles through a name
        # bound earlier, in which case the first compilation restores, as `prepare` does).
        _on_first_torch_compile(self._on_torch_compile)

    def _on_torch_compile(self) -> None:
        # Before torch.compile imports inductor's compile path: its kernel templates compile when first used
        # (`lazy_templates`), its CPU vector-ISA probe is shared and remembered (`isa_probe`), store or not,
        # so is the name of its precompiled header (`pch_memo`),
        # and the hash of torch's sources its cache keys need starts on torch's own prefetch thread.
        if self._warm_imports:
            _header_dir_as_a_cold_start()
        if not _gpu_present():  # a GPU job renders them (autotuning): left as inductor makes them
            lazy_templates.defer(self._patcher)
        shared = isa_probe.share(self._patcher)
        self._pch_memo = pch_memo.share(self._patcher)  # a cache hit needs no preprocessing of the header
        try:  # the hash of torch's sources the first compile's cache lookups need, on torch's prefetch thread
            torch_compat.prefetch_inductor_torch_key()
        except Exception as exc:
            logger.debug("ettr: inductor's torch_key not prefetched (%s)", exc)
        if self.config.store is not None and self.config.restore:
            self._restore_in_background(probe_isa=shared)

    def _restore_in_background(self, *, probe_isa: bool = False) -> None:
        # Restore on a helper thread from now on, so the unpacking overlaps whatever the program does
        # before its first compilation (which waits for it). Key and directories are looked up here, on
        # the calling thread: the helper only reads, checks and writes files. A process without an
        # accelerator then runs inductor's CPU vector-ISA probe there too (`probe_isa`: shared with its
        # first compile): its libraries, and its remembered answer, come with the entry.
        try:
            digest = self.key.digest
            dirs = (artifacts.inductor_cache_dir(), artifacts.headers_dir())
        except Exception as exc:
            logger.debug("ettr: restoring at the first compilation instead (%s)", exc)
            return
        probe = probe_isa and self.key.device_type == "cpu"
        logger.debug("ettr: restoring compile artifacts of entry %s in the background", digest)
        threading.Thread(
            target=self._restore_then_probe, args=(dirs, probe), name="ettr-compile-restore", daemon=True
        ).start()

    def _restore_then_probe(self, dirs: tuple[Path, Path], probe: bool) -> None:
        self._restorer.restore_once(dirs)
        if probe:
            isa_probe.run()

    def close(self) -> None:
        """Emit what is pending and, with `save_at_exit`, save what was compiled since the last save."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            if self._thread_nice is not None and self._thread.is_alive():
                raise_save_thread(*self._thread_nice)  # the exit waits on it: no longer background work
            self._thread.join(timeout=60.0)
        self._emit()
        if self.config.save_at_exit and self._dirty:
            self.save(reason="exit")
        self._emit()
        try:
            self.rec.flush()
        except Exception:
            pass

    @property
    def store(self) -> CompileStore | None:
        if self._store is None and self.config.store is not None:
            self._store = open_store(self.config)
        return self._store

    @property
    def key(self) -> StoreKey:
        if self._key is None:
            self._key = current_key(user_key=self.user_key)
        return self._key

    # -- before the first compile ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Set the PGO job id, apply learned dynamic sources and restore the store entry. Runs once, at the
        start of the first compilation (or earlier when called directly); never raises."""
        with self._lock:
            if self._prepared:
                return
            self._prepared = True
        try:
            import torch

            if torch.compiler.config.job_id is None:
                torch.compiler.config.job_id = pgo_job_id(self.user_key)
        except Exception as exc:
            logger.debug("ettr: cannot set the PGO job id: %s", exc)
        if self.config.restore:
            self._restorer.restore_once(None, timeout_s=self.config.restore_timeout_s)
        megacache = self._restorer.take_megacache()
        if megacache is not None:
            try:
                artifacts.load_megacache(megacache)
            except Exception as exc:
                logger.warning("ettr: cannot load the megacache archive (%s); compiling from scratch", exc)
        if self.config.learn_dynamic:
            try:
                sources = dynamic.merge(
                    self._job_sources(), dynamic.parse_many(self.store_meta.get("dynamic_sources", []))
                )
                if sources:
                    dynamic.apply(sources)
                self.applied_sources = sources
            except Exception as exc:
                logger.warning("ettr: cannot apply learned dynamic sources (%s); compiling without them", exc)

    def _job_sources(self) -> tuple[dynamic.DynamicSource, ...]:
        run_dir = self.rec.run_dir
        if run_dir is None:
            return ()
        return dynamic.load(dynamic.job_file(run_dir))[0]

    # -- during the run ----------------------------------------------------------------------------------
    def _after_compile(self, record: CompileRecord) -> None:
        self._dirty = True
        if record.recompile_reason is not None and self.config.learn_dynamic:
            # At once, on the compiling thread (a small JSON write): a crash or SIGKILL before the settle
            # save must not cost the next attempt this recompile again.
            try:
                self._saver.persist_learned(self.applied_sources)
            except Exception as exc:
                logger.debug("ettr: cannot keep learned dynamic sources: %s", exc)
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._background, name="ettr-compile", daemon=True)
            self._thread.start()
        self._wake.set()

    def _on_step(self, step: int) -> None:
        if self.hooks.num_pending or self._pending_marks:
            self._emit()

    def _background(self) -> None:
        # The settle save (hashing, writing the store's files) runs as nice as a thread gets, with the lowest
        # best-effort I/O priority: on a busy node it takes the cores training leaves. Nothing waits for it
        # (no restart restores from a save in flight) until `close`, which gives its priority back where it
        # may. The exit save runs on the closing thread, at its priority.
        before = lower_save_thread()
        if before is not None:
            self._thread_nice = (threading.get_native_id(), before)
        while not self._closed:
            self._wake.wait(0.5)
            self._wake.clear()
            if self._closed:
                break
            self._emit()
            last = self.hooks.last_end_ts
            if (
                self._dirty
                and last is not None
                and not self.hooks.in_flight
                and time.time() - last >= self.config.settle_s
            ):
                self.save(reason="settled")

    def _emit(self) -> None:
        self.hooks.emit_pending()
        if not self._pending_marks or not self.hooks.quiet():
            return
        with self._lock:
            marks, self._pending_marks = self._pending_marks, []
        for ts, data in marks:
            try:
                self.rec.record(EventKind.MARK, ts=ts, data={"name": STORE_MARK, **data})
            except Exception as exc:
                logger.debug("ettr: cannot record a store mark: %s", exc)

    def _mark(self, ts: float, data: dict[str, Any]) -> None:
        with self._lock:
            self._pending_marks.append((ts, data))
        self._wake.set()

    # -- saving ------------------------------------------------------------------------------------------
    def learned_sources(self) -> tuple[dynamic.DynamicSource, ...]:
        """Dynamic sources learned in this process (PGO profile and recompile reasons) plus applied ones."""
        return self._saver.learned_sources(self.applied_sources)

    def save(self, *, reason: str = "explicit") -> bool:
        """Learn dynamic sources, write them to the run directory, and save the artifacts to the store if
        anything changed since the last save or restore. Never raises; returns True when it saved."""
        if self.hooks.in_flight:
            return False
        self._dirty = False
        return self._saver.save(reason=reason, applied=self.applied_sources, batch_spec=self.batch_spec)


def _on_first_torch_compile(callback: Callable[[], None]) -> None:
    """Run `callback` (once, never raising into the caller) when `torch.compile` is first called."""
    import torch

    original = torch.compile
    fired = threading.Event()

    def compile_(*args: Any, **kwargs: Any) -> Any:
        if not fired.is_set():
            fired.set()
            torch.compile = original  # one look-up is all it is for
            try:
                callback()
            except Exception as exc:
                logger.debug("ettr: compile store restore not started (%s)", exc)
        return original(*args, **kwargs)

    functools.update_wrapper(compile_, original)
    torch.compile = compile_


def _gpu_present() -> bool:
    """Whether this process can use a CUDA device (torch is imported by now: torch.compile was called)."""
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver: as a GPU job, leaving inductor as it is
        return True


def _header_dir_as_a_cold_start() -> None:
    """In a process whose inductor a warm-up imported (a zygote's forked worker, a warm standby), before its
    first compile: inductor's precompiled-header directory where a cold start's import of inductor would have
    put it. Inductor fixes it from TMPDIR when its codecache is imported (`codecache._HEADER_DIR`); the
    warm-up imported it under the warm process's TMPDIR, before the script ran, so a script that points TMPDIR
    elsewhere before it compiles (the demo's `--compile-cache`: fresh local caches per attempt) had its
    headers looked up, built, restored from the compile store and saved to it in the shared default
    directory of the node (`/tmp/torchinductor_$USER/precompiled_headers`) instead of its own: where other
    jobs' headers are, and where every save of the store packed what they had put there. Now both starts
    use the same directory, and the store's restore target follows (`artifacts.headers_dir`)."""
    try:
        moved = torch_compat.inductor_refix_header_dir()
    except Exception as exc:  # inductor moved: the headers stay where the warm-up's import put them
        logger.debug("ettr: inductor's precompiled-header directory left as imported (%s)", exc)
        return
    if moved is not None:
        logger.debug("ettr: inductor's precompiled headers in %s, as at a cold start", moved)
