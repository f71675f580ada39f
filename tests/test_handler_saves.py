"""A checkpoint saved in a signal handler right before the process dies reaches the books."""

from __future__ import annotations

import threading

from ettr.events import Event, EventKind, Phase
from ettr.heartbeat import Progress


def test_the_pulse_listener_is_called_again_by_a_handler_that_interrupted_it() -> None:
    # A signal handler runs on the training thread; if it lands inside the listener and saves, its events
    # come back to the listener on the same thread, the listener's lock still held by the code it stopped.
    progress = Progress()
    end = Event(EventKind.PHASE_END, 2.0, 0, 0, phase=Phase.CHECKPOINT_BLOCKING, value=1.0)

    def interrupted_listener() -> None:
        with progress._lock:  # noqa: SLF001 - where the interrupted `observe` was
            progress.observe(end)  # the handler's save, recorded

    thread = threading.Thread(target=interrupted_listener, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the listener waited for a lock its own thread holds"
