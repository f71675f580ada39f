"""What a script's workers had imported by their first step, remembered on this node for its next job.

A requeued job's zygote imports what the attempt before it had imported by its first step (its `trained_path`
files, `run_env.trained_modules`), once for all local ranks. A new job (attempt 0) has no attempt before it;
where the same script ran before on this node, its agent remembered that list here, and the zygote imports it
instead of `standby_group.WARM_MODULES`: the ranks then skip their own imports of TorchRec, inductor's compile
path, ... (each rank's, on a core the ranks share).

    $XDG_CACHE_HOME/ettr/warm/<digest>.json   (~/.cache/... without it; {"modules": [...]}, mode 0600)

`<digest>`: the worker's interpreter and the script as the worker runs it (its absolute path, or `-m MODULE`
and the working directory), not its other arguments. The file is data: it is read with the requeue's reader
(`run_env.listed_warm_modules`: no symlink, no FIFO, 64 KiB, and only `warmable` names: public parts of
torch and ettr, top-level packages installed in this interpreter's site-packages), so a forged one can only
make the zygote import installed packages; nothing in it runs as code. A stale one costs the zygote the
import of what the script no longer imports (the ranks never see a module they did not import themselves
anyway: they are forked after the imports, as a requeue's are). `ETTR_WARM_MEMO=0` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.run_env import WARM_MEMO_ENV, listed_warm_modules, user_cache_home
from ettr.untrusted import make_dirs_below

logger = logging.getLogger("ettr")

MEMO_DIR = ("ettr", "warm")
"""Below the user's cache home."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(WARM_MEMO_ENV, "1") != "0"


def script_of(argv: Sequence[str], cwd: str) -> list[str] | None:
    """The worker's interpreter and what it runs (`argv` as the agent starts it: python [-opts] SCRIPT |
    -m MODULE, ...): [python, abspath(SCRIPT)] or [python, -m, MODULE, cwd]; None for anything else (`-c`)."""
    at = 1
    while at < len(argv) and argv[at].startswith("-") and argv[at] not in ("-m", "-c", "-"):
        at += 1
    if at >= len(argv) or argv[at] in ("-c", "-"):
        return None
    if argv[at] == "-m":
        return [argv[0], "-m", argv[at + 1], cwd] if at + 1 < len(argv) else None
    return [argv[0], os.path.abspath(os.path.join(cwd, argv[at]))]


def memo_path(argv: Sequence[str], cwd: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """Where this node remembers the imports of workers `argv` started in `cwd`; None: not remembered."""
    script = script_of(argv, cwd)
    if script is None or not enabled(environ):
        return None
    digest = hashlib.sha256(json.dumps(script).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(user_cache_home(environ), *MEMO_DIR, f"{digest}.json")


def recall(
    argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], cwd: str | None = None
) -> list[str]:
    """What workers `argvs` (environments `envs`, started in `cwd`, the current directory by default) had
    imported by their first step when the same script last ran on this node: only `warmable` names, in the
    order remembered; [] when nothing is."""
    path = memo_path(argvs[0], cwd or os.getcwd(), envs[0]) if argvs else None
    return [] if path is None else listed_warm_modules(path)


def remember(
    argvs: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    modules: Sequence[str],
    cwd: str | None = None,
) -> None:
    """Remember `modules` (what an attempt of workers `argvs`, environments `envs`, had imported by its first
    step) for the next job of the same script on this node. Never raises: a memo that cannot be written is a
    slower next start."""
    path = memo_path(argvs[0], cwd or os.getcwd(), envs[0]) if argvs and modules else None
    if path is None:
        return
    try:
        if listed_warm_modules(path) == list(modules):
            return
        make_dirs_below(user_cache_home(envs[0]), path.parent, mode=0o700)
        atomic_write(path, json.dumps({"modules": list(modules)}), mode=0o600, durable=False)
    except (OSError, ValueError) as exc:
        logger.debug("ettr: the workers' imports not remembered for the next job (%s)", exc)
