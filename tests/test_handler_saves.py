"""A checkpoint saved in a signal handler right before the process dies reaches the books."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from ettr.events import Event, EventKind, Phase
from ettr.heartbeat import Progress

# Steps until told to stop; its SIGTERM handler saves, then dies of the signal (SIG_DFL), as many scripts do.
_SAVES_IN_ITS_HANDLER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from ettr.runtime import get_recorder

    # The ledger is busy (other ranks, the supervisor): the writer thread's commit lands late, if ever.
    ledger = get_recorder()._ledger
    append = ledger.append

    def busy_append(events):
        if threading.current_thread() is not threading.main_thread() and any(
            e.kind == "checkpoint_commit" for e in events
        ):
            time.sleep(0.3)
        append(events)

    ledger.append = busy_append
    # The bound on the commit's flush is what a busy ledger gets; on a loaded machine the writer may need
    # longer than it for reasons of its own: the test asks that the flush happens, not how fast.
    import ettr.bootstrap.checkpoint_hooks as checkpoint_hooks
    checkpoint_hooks.COMMIT_FLUSH_S = 60.0
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def on_sigterm(signum, frame):
        torch.save(model.state_dict(), os.path.join(sys.argv[1], "on_sigterm.pt"))
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    for step in range(1, 6000):  # about a minute, should the test never signal it
        model(torch.randn(4, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            print("stepped", os.getpid(), flush=True)
        time.sleep(0.01)
    """
)


def test_a_save_in_a_sigterm_handler_that_reraises_the_signal_is_committed(tmp_path: Path) -> None:
    from ettr.ledger import read_run_events

    script = tmp_path / "train.py"
    script.write_text(_SAVES_IN_ITS_HANDLER)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    command = [
        sys.executable, "-m", "ettr", "run", "--run-dir", str(run_dir), "--max-restarts", "0", "--",
        sys.executable, str(script), str(tmp_path),
    ]  # fmt: skip
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            assert run.stdout is not None
            pid = next((int(line.split()[1]) for line in run.stdout if line.startswith("stepped")), None)
            assert pid is not None, run.stderr.read() if run.stderr else ""
            os.kill(pid, signal.SIGTERM)  # the training process, as a scheduler signals it; not `ettr run`
            _, err = run.communicate(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
    assert (tmp_path / "on_sigterm.pt").is_file(), err[-2000:]
    commits = [e for e in read_run_events(run_dir) if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert [Path((e.data or {})["path"]).name for e in commits] == ["on_sigterm.pt"], err[-2000:]
    assert commits[0].step is not None and commits[0].step >= 3


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
