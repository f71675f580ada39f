"""What a compile session does (`CompileConfig`), and the names it derives from the workload's key.

Everything here is computed without importing torch, so `autoinstall` can read its configuration and
choose the inductor cache directory before torch's compiler is loaded.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ettr.constants import DEFAULT_STORE_MAX_BYTES
from ettr.run_env import (
    COMPILE_ENV,
    COMPILE_KEY_ENV,
    COMPILE_PRIVATE_CACHE_ENV,
    COMPILE_RESTORE_ENV,
    COMPILE_SETTLE_S_ENV,
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    COMPILE_STORE_SECRET_ENV,
)

DEFAULT_STORE = "~/.cache/ettr/compile"
"""The store without `ETTR_COMPILE_STORE` (or `$XDG_CACHE_HOME/ettr/compile` when that is set): private
to the user (created 0700; a directory others could write is refused, see `ettr.compile.safety`)."""

logger = logging.getLogger("ettr")


def default_store(env: Mapping[str, str] | None = None) -> str:
    """`$XDG_CACHE_HOME/ettr/compile` when XDG_CACHE_HOME is an absolute path, else `DEFAULT_STORE`."""
    xdg = (os.environ if env is None else env).get("XDG_CACHE_HOME", "")
    return os.path.join(xdg, "ettr", "compile") if os.path.isabs(xdg) else DEFAULT_STORE


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """What the compile session does. `from_env` reads it from the environment `ettr run` passes on."""

    store: str | None = DEFAULT_STORE
    """Store directory or fsspec URL; None: no store (recording and dynamic sources only)."""
    user_key: str = ""
    """The workload, part of the store key; "" means the main script's absolute path."""
    max_store_bytes: int = DEFAULT_STORE_MAX_BYTES
    """Size bound of the whole store (least recently used entries are evicted)."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC key for store manifests (only signed entries load when set)."""
    restore: bool = True
    """Restore the store's entry before the first compilation; False: only save to the store (the job
    compiles cold, as without a store, and leaves its artifacts for later jobs)."""
    settle_s: float = 10.0
    """Save once no compilation has run for this long."""
    save_at_exit: bool = True
    """Save at interpreter exit when something was compiled since the last save."""
    save_rank: int | None = 0
    """Only this global rank saves (ranks of an SPMD job compile the same); None: every rank saves."""
    learn_dynamic: bool = True
    """Learn dynamic sources from recompiles and apply learned ones before compiling."""
    include_megacache: bool = True
    """Also save `torch.compiler.save_cache_artifacts()` in the entry."""
    private_cache_dir: bool = True
    """Under `autoinstall`, give the workload its own inductor cache directory beside inductor's default
    one (unless `TORCHINDUCTOR_CACHE_DIR` is set): restarts on the node still find it, and store entries
    hold this workload's kernels rather than everything the node ever compiled."""
    restore_timeout_s: float = 300.0
    """How long the first compilation waits for a restore still in progress before going on without it."""

    def __post_init__(self) -> None:
        if self.store is not None and not self.store:
            raise ValueError("CompileConfig.store must be a path/URL or None")
        if self.max_store_bytes <= 0:
            raise ValueError(f"CompileConfig.max_store_bytes must be > 0, got {self.max_store_bytes}")
        if not self.settle_s >= 0:
            raise ValueError(f"CompileConfig.settle_s must be >= 0, got {self.settle_s}")
        if not self.restore_timeout_s >= 0:
            raise ValueError(f"CompileConfig.restore_timeout_s must be >= 0, got {self.restore_timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CompileConfig | None:
        """Config from `ETTR_COMPILE` (`0` turns everything off: returns None), `ETTR_COMPILE_STORE`
        (`off` for no store), `ETTR_COMPILE_RESTORE` (`0`: save only), `ETTR_COMPILE_KEY`, `ETTR_COMPILE_STORE_MAX_BYTES`,
        `ETTR_COMPILE_STORE_SECRET`, `ETTR_COMPILE_SETTLE_S`. Malformed numbers fall back to defaults."""
        env = os.environ if environ is None else environ
        if env.get(COMPILE_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
            return None
        fallback = default_store(env)
        store_text = env.get(COMPILE_STORE_ENV, fallback).strip() or fallback
        store: str | None = None if store_text.lower() in ("off", "none", "0") else store_text
        secret = env.get(COMPILE_STORE_SECRET_ENV) or None

        def number(name: str, default: float, kind: type) -> Any:
            if name not in env:
                return default
            try:
                value = kind(env[name])
            except ValueError:
                value = None
            if value is None or not math.isfinite(value) or value < 0:  # a typo must not pass unnoticed
                what = "a whole number of bytes" if kind is int else "a number of seconds >= 0"
                logger.warning("ettr: %s=%r is not %s; using %s", name, env[name][:40], what, default)
                return default
            return value

        return cls(
            store=store,
            private_cache_dir=env.get(COMPILE_PRIVATE_CACHE_ENV, "1").strip().lower()
            not in ("0", "off", "false"),
            restore=env.get(COMPILE_RESTORE_ENV, "1").strip().lower() not in ("0", "off", "false", "no"),
            user_key=env.get(COMPILE_KEY_ENV, ""),
            max_store_bytes=number(COMPILE_STORE_MAX_BYTES_ENV, DEFAULT_STORE_MAX_BYTES, int)
            or DEFAULT_STORE_MAX_BYTES,
            secret=os.fsencode(secret) if secret else None,  # as given (not UTF-8: no UnicodeEncodeError)
            settle_s=number(COMPILE_SETTLE_S_ENV, 10.0, float),
        )


def default_user_key() -> str:
    """The main script's absolute path (`-c` and the REPL give the working directory)."""
    main = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else os.getcwd()
    return os.path.abspath(main)


def private_cache_dir(user_key: str) -> str:
    """The workload's inductor cache directory: `$TMPDIR/torchinductor_$USER/ettr-<digest>`, beside
    inductor's default one (and its precompiled headers), computed without importing torch. Its name is
    predictable, so `autoinstall` makes and checks it before using it (`inductor_cache_dir`)."""
    return os.path.join(tempfile.gettempdir(), *private_cache_parts(user_key))


def private_cache_parts(user_key: str) -> tuple[str, str]:
    """`torchinductor_$USER` and `ettr-<digest of the user key>`: the two directories of
    `private_cache_dir` below `$TMPDIR`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    digest = hashlib.sha256(os.fsencode(user_key)).hexdigest()[:16]  # a script path need not be UTF-8
    return f"torchinductor_{user}", f"ettr-{digest}"


def pgo_job_id(user_key: str) -> str:
    """The PGO job id ettr sets: the same for every job of a workload, so later jobs reuse profiles."""
    return "ettr-" + hashlib.sha256(os.fsencode(user_key)).hexdigest()[:16]
