"""A spare, the process side: a replacement for one local rank that ran the script's top level ahead of a
failure and waits, parked before `ettr.resilient`'s first rendezvous, until ettr's agent promotes it.

ettr's agent (`ettr.supervisor.spares`) forks it from the node's zygote once an attempt has trained, with the
next attempt's environment and `ETTR_SPARE` naming a FIFO. Until it is promoted it writes nothing the books,
the watchdog or the hang check read: the bootstrap only holds (`hold`: no recorder, heartbeat, step tail,
first-step or exit marker, injected fault), and a recorder the script makes meanwhile records nothing
(`ettr.runtime`'s held recorder). At `park` (called by the in-place wrapper before anything else) it says it
parked (`ettr.run_env.spare_parked_path`: its pid and the time, beside the FIFO, never in an attempt's
directory) and reads the FIFO: one JSON line promotes it ({"env": the attempt's names known only at its
start, "promoted_at": TS}); EOF without one (the agent ended it, or is gone) exits 0 at once, through
`os._exit`, so that no exit handler writes anything. Promoted, it takes those names, runs the bootstrap as a
process of the attempt that starts at `promoted_at` (`ettr.bootstrap.start.promote_spare`), and the wrapper
goes on into the attempt's first rendezvous.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any

_state: dict[str, Any] = {}


def is_held() -> bool:
    """Whether this process is a spare that has not been promoted (it records nothing)."""
    return bool(_state.get("held"))


def hold(fifo: str) -> None:
    """This process is a spare waiting on `fifo` (the bootstrap's `start`, instead of instrumenting it)."""
    _state.update(held=True, fifo=fifo, origin=None)


def note_origin(mark: str, fields: dict[str, float]) -> None:
    """Where the spare came from (the zygote's MARK and its times), said once it is promoted."""
    _state["origin"] = (mark, dict(fields))


def park() -> bool:
    """In a spare: say it parked, wait until promoted (then True: its environment is the attempt's now) or
    ended (exits). Elsewhere: False at once."""
    if not is_held():
        return False
    from ettr.run_env import spare_parked_path

    fifo = str(_state["fifo"])
    _import_ahead()
    _compile_ahead()
    parked_at = time.time()
    _say_parked(fifo, parked_at)
    message = _wait(fifo)
    for path in (fifo, spare_parked_path(fifo)):  # its own hints, read: nobody looks for them again
        try:
            os.unlink(path)
        except OSError:
            pass
    if message is None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)  # ended: no exit handler may write anything of an attempt it never joined
    _promote(message, parked_at)
    return True


IMPORT_AHEAD = (
    "ettr.ledger.url",
    "ettr.ledger.sqlite",
    "ettr.heartbeat",
    "ettr.steptail",
    "ettr.inject",
    "ettr.bootstrap.hooks",
    "ettr.bootstrap.checkpoint_hooks",
    "ettr.bootstrap.eval_hooks",
    "ettr.bootstrap.loader_eval",
    "ettr.bootstrap.group_teardown",
    "ettr.bootstrap.long_calls",
    "ettr.bootstrap.outside_signals",
    "ettr.bootstrap.frameworks",
    "ettr.compile.autoinstall",
)
"""What the bootstrap imports when the spare is promoted (`ettr.bootstrap.start._start` and the hooks it
installs), imported before it parks: imports only (ettr's modules do nothing at import), off the recovery."""


def _import_ahead() -> None:
    import importlib

    for name in IMPORT_AHEAD:
        try:
            importlib.import_module(name)
        except Exception:  # the promotion imports it then, or does without
            pass


def _compile_ahead() -> None:
    """The compile store's restore into the directories the script's top level chose, on a low-priority
    thread while the spare waits (`ettr.compile.ahead`); booked by the compile session after the promotion."""
    try:
        from ettr.compile.autoinstall import restore_ahead

        restore_ahead()
    except Exception:  # the promoted process restores at its first compile, as before
        pass


def _say_parked(fifo: str, parked_at: float) -> None:
    from ettr.atomic import atomic_write
    from ettr.run_env import spare_parked_path

    try:
        data = json.dumps({"pid": os.getpid(), "parked_at": parked_at}).encode()
        atomic_write(spare_parked_path(fifo), data, durable=False)  # a hint for the agent, not a record
    except Exception:
        pass  # the agent then promotes it as one not yet parked


def _wait(fifo: str) -> dict[str, Any] | None:
    """The promotion message from the FIFO, or None (EOF, or not a FIFO of ours, or unreadable)."""
    from ettr.run_env import SPARE_MESSAGE_MAX_BYTES
    from ettr.untrusted import loads_bounded

    try:
        fd = os.open(fifo, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the agent holds the write end
    except OSError:
        return None
    data = b""
    try:
        info = os.fstat(fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.getuid():
            return None
        while b"\n" not in data and len(data) <= SPARE_MESSAGE_MAX_BYTES:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    finally:
        os.close(fd)
    line, newline, _ = data.partition(b"\n")
    if not newline:
        return None
    try:
        message = loads_bounded(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _promote(message: dict[str, Any], parked_at: float) -> None:
    from ettr.run_env import SPARE_ENV, SPARE_LATE_NAMES

    env = message.get("env")
    for name, value in env.items() if isinstance(env, dict) else ():
        if name in SPARE_LATE_NAMES and isinstance(value, str):
            os.environ[name] = value
    os.environ.pop(SPARE_ENV, None)
    promoted_at = message.get("promoted_at")
    if not isinstance(promoted_at, (int, float)) or isinstance(promoted_at, bool):
        promoted_at = time.time()
    _state["held"] = False
    origin: tuple[str, dict[str, float]] = _state.get("origin") or ("spare", {})
    mark, fields = origin
    from ettr.bootstrap.start import promote_spare

    promote_spare(
        float(promoted_at),
        {**fields, "parked_at": parked_at, "promoted_at": float(promoted_at), "from": mark},
    )
