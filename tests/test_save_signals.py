"""A SIGTERM or SIGINT during a script's checkpoint save waits until the file is complete (bootstrap.save_signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ettr.bootstrap import pythonpath_dir
from ettr.events import EventKind
from ettr.ledger import open_ledger


def _python(code: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_block_is_delivered_after_it(tmp_path: Path, sig: signal.Signals) -> None:
    done = _python(
        f"""
        import os, signal
        from ettr.bootstrap.save_signals import held_stop_signals
        # Python's own SIGINT handler, as in a terminal (a child of a process that ignores SIGINT, a pytest-xdist
        # worker, inherits SIG_IGN, and an ignored signal is left alone)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with held_stop_signals("ckpt.pt"):
            os.kill(os.getpid(), {int(sig)})
            open("written", "w").close()  # the rest of the save runs
        open("after", "w").close()  # never: the signal's default action (or KeyboardInterrupt) comes first
        """,
        tmp_path,
    )
    assert (tmp_path / "written").exists() and not (tmp_path / "after").exists(), done.stderr
    if sig == signal.SIGTERM:
        assert done.returncode == -signal.SIGTERM
    else:
        assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr
    assert f"ettr: {sig.name} came during the checkpoint save of ckpt.pt; delivered once" in done.stderr


def test_the_scripts_own_handler_runs_once_after_the_block_and_an_ignored_signal_stays_ignored(
    tmp_path: Path,
) -> None:
    done = _python(
        """
        import os, signal, sys, threading
        from ettr.bootstrap.save_signals import held_stop_signals
        calls = []
        signal.signal(signal.SIGTERM, lambda s, f: calls.append("handler"))
        signal.signal(signal.SIGUSR1, lambda s, f: calls.append("usr1"))  # not a stop signal: not held
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with held_stop_signals("ckpt.pt"):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the same stop again: delivered once
            os.kill(os.getpid(), signal.SIGINT)
            calls.append("saved")
        calls.append("after")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        # another thread's save holds nothing (handlers belong to the main thread)
        def other():
            with held_stop_signals("x"):
                calls.append("thread")
        t = threading.Thread(target=other); t.start(); t.join()
        print(calls)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['saved', 'handler', 'after', 'thread']"


def test_a_preemption_in_the_middle_of_an_unmodified_scripts_torch_save_keeps_the_file_and_its_commit(
    tmp_path: Path,
) -> None:
    # nanoGPT's pattern: torch.save to the final name, no SIGTERM handler. The SIGTERM comes while torch.save
    # pickles the checkpoint (from an object's __reduce__: mid-save by construction). It ended the process
    # inside torch.save: ckpt.pt torn (or missing) and no commit in the books.
    run_dir = tmp_path / "run"
    code = """
        import os, signal, time, torch
        class Preempted:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # time for the default action to end the process, were the signal not held
                return (int, (7,))
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(4, 64)).sum().backward()
            opt.step(); opt.zero_grad()
        torch.save({"model": model.state_dict(), "when": Preempted(), "iter_num": 3,
                    "more": torch.zeros(1 << 20)}, "ckpt.pt")
        open("after", "w").close()
        """
    env = {
        "PYTHONPATH": str(pythonpath_dir()),
        "ETTR_RUN_DIR": str(run_dir),
        "ETTR_ATTEMPT": "0",
        "RANK": "0",
    }
    done = _python(code, tmp_path, env)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert not (tmp_path / "after").exists()
    assert "ettr: SIGTERM came during the checkpoint save of" in done.stderr
    check = _python("import torch; print(torch.load('ckpt.pt', weights_only=False)['when'])", tmp_path)
    assert check.stdout.strip() == "7", check.stderr  # the whole file, loadable
    commits = [e for e in open_ledger(run_dir).read() if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert [Path(str((e.data or {})["path"])).name for e in commits] == ["ckpt.pt"]
