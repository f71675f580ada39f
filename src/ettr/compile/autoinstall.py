"""The one entry point the zero-code bootstrap calls at process start: `autoinstall(rec)`.

It costs nothing in a process that never compiles: it only waits for `torch._dynamo` to be imported
(which `torch.compile` does on first use and `import torch` does not) through `ettr.post_import`,
and then starts a `CompileSession` (hooks, restore before the first compile, save after it settles).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ettr.compile import ahead
from ettr.compile.config import CompileConfig, default_user_key, private_cache_parts
from ettr.compile.safety import make_private_dirs_below
from ettr.compile.session import CompileSession
from ettr.post_import import when_imported
from ettr.run_env import user_cache_home

if TYPE_CHECKING:
    from ettr.recorder import RecorderProtocol

logger = logging.getLogger("ettr")

_TRIGGER_MODULE = "torch._dynamo"

_lock = threading.Lock()
_session: CompileSession | None = None
_armed: int | None = None  # the generation whose post-import watch is waiting for torch._dynamo
_generation = 0
_warm_imports_only = False  # torch._inductor was imported by a standby's warm-up, which compiled nothing


def after_warm_up() -> None:
    """Called by a warm standby (`ettr.bootstrap.standby`) at its hand-over, before the bootstrap: its
    warm-up imported torch._dynamo (so torch._inductor) and compiled nothing, and importing
    `torch._dynamo.package` left inductor's *default* cache directory in the environment it has since
    replaced by the attempt's. The workload's own cache directory is then chosen as at a cold start, not
    left to the default that every workload of the node shares (whose files a save would pack)."""
    global _warm_imports_only
    _warm_imports_only = True


def restore_ahead() -> bool:
    """Called by a spare as it parks (`ettr.bootstrap.spare.park`), before its promotion: choose the
    workload's cache directory as `autoinstall` will at the promotion (the environment is the same), then
    restore the compile store's entry into it on a low-priority thread (`ettr.compile.ahead`), booking
    nothing; the session started after the promotion checks it and says it in its restore's MARK. Only where
    inductor's compile path is imported already (the zygote's warm-up imports it when the trained attempt had:
    `ettr.bootstrap.start.TORCH_PARTS`): a script that does not compile restores nothing (the build's 157 MB
    precompiled header, which a store restores to a workload without an entry of its own). Whether it
    started; never raises."""
    try:
        if "torch._inductor.codecache" not in sys.modules:
            return False
        config = CompileConfig.from_env()
        if config is None:
            return False
        _use_private_cache_dir(config)
        return ahead.start(config, refix_headers=_warm_imports_only)
    except Exception as exc:
        logger.debug("ettr: no ahead restore (%s: %s)", type(exc).__name__, exc)
        return False


def _start_session(rec: RecorderProtocol, config: CompileConfig, generation: int | None = None) -> None:
    global _session
    with _lock:
        if _session is not None or (generation is not None and generation != _generation):
            return  # started already, or armed before a reset (tests)
        session = CompileSession(rec, config, warm_imports=_warm_imports_only, ahead=ahead.take())
        session.start()
        _session = session


def autoinstall(rec: RecorderProtocol | None = None, *, config: CompileConfig | None = None) -> bool:
    """Arrange for this process's compilations to be recorded, restored and saved. Never raises.

    Args:
        rec: the Recorder (default: `ettr.get_recorder()`).
        config: what to do (default: `CompileConfig.from_env()`; `ETTR_COMPILE=0` turns it off).

    Returns True when the session is installed or armed (it starts when `torch._dynamo` is imported),
    False when turned off or on error. Calling it again is a no-op.

    In effect, once `torch._dynamo` is imported: Dynamo compile callbacks record each compilation as a
    COMPILE span and each recompile (with its guard-failure reason) as a RECOMPILE event; at the start
    of the first compilation `torch.compiler.config.job_id` is set (if unset) so PGO profiles are kept,
    dynamic sources learned by earlier attempts (`<run_dir>/compile/dynamic.json`) and earlier jobs (the
    store entry) are applied, and the store entry for this torch/Python/platform/device/inductor-config
    and workload is restored; after compilations settle (`ETTR_COMPILE_SETTLE_S`, 10 s) and at exit, a
    background thread saves the artifacts (rank 0 only); learned dynamic sources are written to the run
    directory at each recompile. Unless `TORCHINDUCTOR_CACHE_DIR` is set (or torch._inductor is already
    imported), it points inductor at a cache directory of the workload's own (`inductor_cache_dir`).
    """
    global _armed
    try:
        if config is None:
            config = CompileConfig.from_env()
            if config is None:
                return False
        if rec is None:
            from ettr.runtime import get_recorder

            rec = get_recorder()
        _use_private_cache_dir(config)
        with _lock:
            if _session is not None or _armed is not None:
                return True
            if _TRIGGER_MODULE not in sys.modules:
                generation = _armed = _generation
                when_imported(_TRIGGER_MODULE, lambda _module: _start_session(rec, config, generation))
                return True
        _start_session(rec, config)
        return True
    except Exception as exc:
        logger.warning("ettr: compile support off (%s: %s)", type(exc).__name__, exc)
        return False


def _use_private_cache_dir(config: CompileConfig) -> None:
    # Only before inductor has looked at its cache directory: a process must not split its files. A
    # standby's warm-up imported inductor without compiling (`after_warm_up`): nothing was put there yet.
    if (
        not config.private_cache_dir
        or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or ("torch._inductor" in sys.modules and not _warm_imports_only)
    ):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(config.user_key or default_user_key())


def inductor_cache_dir(user_key: str) -> str:
    """The workload's inductor cache directory, made if missing and checked private (this user's, no
    symlink, not group/world-writable; `make_private_dirs_below`): inductor runs the code it finds there.

    `config.private_cache_dir` (`$TMPDIR/torchinductor_$USER/ettr-<digest>`) when both of its directories
    pass; its name is predictable, so another local user may have made one first. Else
    `$XDG_CACHE_HOME/ettr/inductor/ettr-<digest>` (or `~/.cache/...`), else a fresh `tempfile.mkdtemp`
    directory, with one logged line saying why. Raises only what `mkdtemp` raises."""
    user_dir, workload_dir = private_cache_parts(user_key)
    tmp = Path(tempfile.gettempdir())
    try:
        return os.fspath(make_private_dirs_below(tmp, PurePosixPath(user_dir, workload_dir)))
    except OSError as exc:
        refused = exc
    try:
        home = Path(user_cache_home())
        chosen = os.fspath(make_private_dirs_below(home, PurePosixPath("ettr", "inductor", workload_dir)))
    except OSError:
        chosen = tempfile.mkdtemp(prefix=f"ettr-inductor-{workload_dir}-")
    logger.warning(
        "ettr: inductor cache directory %s, not %s (%s)", chosen, tmp / user_dir / workload_dir, refused
    )
    return chosen


def current_session() -> CompileSession | None:
    """The session `autoinstall` started in this process, if any (None before `torch._dynamo` loads)."""
    return _session
