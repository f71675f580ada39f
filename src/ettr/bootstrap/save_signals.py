"""A stop signal that lands while the script writes a checkpoint file waits until the file is complete.

Unmodified scripts save to the final name, `torch.save(checkpoint, "ckpt.pt")` (nanoGPT, pytorch/examples, many
more), and most have no SIGTERM handler: a scheduler's SIGTERM (a Slurm requeue or preemption, `ettr run`
forwarding one) ends the process at once. A requeue 0.03 s into nanoGPT's save under real Slurm left a torn
`ckpt.pt` (field trial, session 11): the last checkpoint was gone, and a script that resumes from that file
fails to load it in every later attempt. A Python handler of the script's own (or Python's KeyboardInterrupt
for SIGINT) runs between two bytecodes of the main thread, which may be inside `torch.save`: one that exits
tears the file the same way.

So while the main thread is inside a save of a checkpoint file (`torch.save` or safetensors' `save_file` to
a path or an open file, the calls `checkpoint_hooks` times), SIGTERM and SIGINT are held: a handler that only
notes them is installed for the call, through the interpreter's own `_signal.signal` (not the script-facing
wrapper of `outside_signals`, which would note a signal the script never handled), and the script's
disposition is put back when the call has returned and its commit is in the books. Each noted signal is then
raised again (`signal.raise_signal`): the default action ends the process, or the script's handler runs, as
it would have, a save later. One line on stderr says so. A signal the script ignores (SIG_IGN) is left alone;
saves of other threads are not held (a handler can only be set from the main thread, and the main thread
runs it: a held signal never stops another thread's write). What bounds the wait: the scheduler's grace
before its SIGKILL (Slurm's KillWait, 30 s by default), and `ettr run`'s own (docs/supervisor.md) — a save
longer than those is cut as before.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HELD = (signal.SIGTERM, signal.SIGINT)
"""The stop signals held during a save (what a scheduler and a person send to end a job)."""

_depth = 0  # saves of the main thread in progress (a handler's save inside a save holds nothing more)


def _raw_signal() -> Any:
    """The interpreter's own `signal`, below `signal.signal` (which `outside_signals` wraps)."""
    import importlib

    return importlib.import_module("_signal").signal


@contextmanager
def held_stop_signals(what: str) -> Iterator[None]:
    """Hold SIGTERM and SIGINT for the block when run in the main thread (see the module docstring);
    never raises of its own, and a no-op where handlers cannot be set."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth:
        yield
        return
    noted: dict[int, float] = {}  # signal -> when it came (monotonic)
    before: dict[int, Any] = {}

    def note(signum: int, frame: Any) -> None:
        noted.setdefault(signum, time.monotonic())

    try:
        set_handler = _raw_signal()
        for sig in HELD:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN or current is None:  # ignored, or set outside Python: left alone
                continue
            before[sig] = set_handler(sig, note)
    except (ValueError, OSError, RuntimeError, ImportError):
        pass
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        _release(before, noted, what)


def _release(before: dict[int, Any], noted: dict[int, float], what: str) -> None:
    try:
        set_handler = _raw_signal()
        for sig, handler in before.items():
            set_handler(sig, handler)
    except (ValueError, OSError, RuntimeError, ImportError):
        return
    for sig, came in list(noted.items()):
        if sig not in before:
            continue
        try:
            from ettr.untrusted import printable
            from ettr.warn import say

            name = signal.Signals(sig).name
            say(
                f"ettr: {name} came during the checkpoint save of {printable(what)}; delivered once the file "
                f"was complete ({time.monotonic() - came:.2f} s later)"
            )
        except Exception:
            pass
        signal.raise_signal(sig)
