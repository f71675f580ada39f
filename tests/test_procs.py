"""The one process helper: start ticks, the liveness policy (pid + start ticks), descendants, PDEATHSIG."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ettr import procs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_start_ticks_tell_a_process_from_a_later_one_with_its_pid():
    me = procs.start_ticks(os.getpid())
    assert isinstance(me, int) and me > 0
    assert procs.pid_alive(os.getpid(), me)
    assert not procs.pid_alive(os.getpid(), me + 1)  # the pid, reused by someone else
    assert procs.start_ticks(_dead_pid()) is None


def test_unknown_start_ticks_mean_the_pid_exists():
    assert procs.pid_alive(os.getpid(), None)
    assert not procs.pid_alive(_dead_pid(), None)
    assert not procs.pid_alive(0, None) and not procs.pid_alive(-1, 5)


def test_recorded_ticks_of_a_gone_process_are_dead():
    pid = _dead_pid()
    assert not procs.pid_alive(pid, 12345)


def test_process_start_time_is_before_now():
    start = procs.process_start_time()
    assert start <= time.time() and time.time() - start < 3600


def test_descendants_and_the_parent_death_signal():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(200):
            found = procs.descendants(proc.pid)
            if found:
                break
            time.sleep(0.05)
        assert len(found) == 1 and found[0][1] == procs.start_ticks(found[0][0])
    finally:
        for pid, _ticks in procs.descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    calls = []
    assert procs.set_parent_death_signal(signal.SIGTERM, prctl=lambda *a: calls.append(a) or 0)
    assert calls == [(1, int(signal.SIGTERM), 0, 0, 0)]
    assert not procs.set_parent_death_signal(prctl=lambda *a: -1)


def test_a_worker_in_its_own_session_at_idle_priority_lowers_its_autogroup_and_gets_it_back():
    """ettr's agent starts workers and standbys as torchrun does, each in a session of its own (with
    sched_autogroup a session's processes share one CPU share); an idle standby's session must then not
    compete at full weight: its autogroup goes to nice 19 with the idle policy, and back at promotion."""
    from ettr.supervisor.process import AttemptProcess

    if os.isatty(0):
        pytest.skip("on a terminal the command stays in the foreground group (Ctrl-C, pdb)")

    worker = AttemptProcess([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    shared = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the caller's session
    try:
        assert os.getsid(worker.pid) == worker.pid  # a session (and a process group) of its own
        assert os.getsid(shared.pid) == os.getsid(0)
        assert not procs.set_autogroup_nice(shared.pid, 19)  # not its own group: the caller's is left alone
        autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled")
        on = autogroups.is_file() and autogroups.read_text().strip() == "1"
        if procs.idle_scheduling(worker.pid) and on:
            assert Path(f"/proc/{worker.pid}/autogroup").read_text().split()[-1] == "19"
            assert procs.normal_scheduling(worker.pid)
            assert Path(f"/proc/{worker.pid}/autogroup").read_text().split()[-1] == "0"
    finally:
        worker.signal_tree(signal.SIGKILL)
        worker.proc.wait()
        shared.kill()
        shared.wait()


def test_a_process_that_handles_a_signal_is_told_by_its_sigcgt_mask():
    code = (
        "import signal, sys; signal.signal(signal.SIGUSR1, lambda *a: None); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert procs.handles_signal(proc.pid, signal.SIGUSR1)
        assert not procs.handles_signal(proc.pid, signal.SIGUSR2)  # Python's default: not caught
    finally:
        proc.communicate("")
    assert not procs.handles_signal(_dead_pid(), signal.SIGUSR1)


def test_the_topmost_handlers_are_the_training_processes_not_their_forked_workers():
    # 1 the command (a shell: no handler) -> 2 rank 0 (handler) -> 3 its data-loader worker (inherited handler)
    #                                     -> 4 rank 1 (handler); 5 a launcher (handles it) -> 6 (handler)
    parent = {2: 1, 3: 2, 4: 1, 5: 1, 6: 5, 7: 1}
    handling = {2, 3, 4, 5, 6}
    found = procs.topmost_handlers(
        [1, 2, 3, 4, 5, 6, 7], signal.SIGUSR1,
        handles=lambda pid, sig: pid in handling, parent_of=parent.get,
    )  # fmt: skip
    assert found == [2, 4, 5]
    # a handler whose parent is not among the attempt's processes (the supervisor's child) is topmost
    assert procs.topmost_handlers([3], signal.SIGUSR1, handles=lambda p, s: True, parent_of=parent.get) == [3]


def test_libc_prctl_is_resolved_once() -> None:
    """The supervisor resolves it before every process it starts; each `ctypes.CDLL` made a new class (a soak's
    tracemalloc showed it growing with the restarts)."""
    from ettr.procs import libc_prctl

    assert libc_prctl() is libc_prctl()


def test_a_stop_signal_is_held_back_from_the_log_reader_a_python_process_writes_to(tmp_path):
    """`torchrun ... 2>&1 | tee train.log` in a wrapper: ettr's SIGTERM reached `tee` with the ranks, and rank
    0's print in its own SIGTERM handler died of a broken pipe (a save after the print was lost), the
    last lines never reached the log. The reader (no Python process, reading a pipe a Python process of
    the job writes) gets no SIGTERM; it ends at the end of its input. A Python reader still gets it."""
    from ettr.supervisor.process import AttemptProcess

    out, got = tmp_path / "train.log", tmp_path / "reader-signalled"
    writer = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('saving checkpoint', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    reader = f"trap 'echo TERM >> {got}' TERM; cat > {out}"
    script = f'{sys.executable} -c "$WRITER" | sh -c "$READER"'
    env = dict(os.environ, WRITER=writer, READER=reader)
    job = AttemptProcess(["bash", "-c", script], env)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        job.remember_tree()
        python_pids = [p for p in job.known_tree() if procs._is_python(p)]
        assert python_pids and procs.log_readers([job.pid, *job.known_tree()])
        reached = job.signal_tree(signal.SIGTERM)
        assert set(python_pids) <= set(reached)
        # bash itself dies of the SIGTERM at once; the tree drains after it (as `ettr run` lets it, within
        # its grace): wait for every process of it, not for bash
        deadline = time.monotonic() + 60
        while job.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not job.alive()
    finally:
        job.signal_tree(signal.SIGKILL)
        job.wait(10)
    assert out.read_text().split() == ["ready", "saving", "checkpoint"]
    assert not got.exists()


def test_a_python_reader_of_a_pipe_is_no_log_reader(tmp_path):
    """`cat data | python train.py`: the trainer reads a pipe, but cat is no Python process, and the trainer
    is one: it is signalled as ever."""
    feeder = subprocess.Popen([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)  # fmt: skip
    trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=feeder.stdout)
    try:
        assert procs.log_readers([feeder.pid, trainer.pid]) == set()
    finally:
        for p in (feeder, trainer):
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    ("layout", "files", "expected"),
    [
        (  # cgroup v2 alone
            "0::/job/step\n",
            {"job/step/memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n"},
            2,
        ),
        (  # hybrid: v2 mounted at unified, with the memory controller there
            "1:name=systemd:/job\n0::/job\n",
            {"unified/job/memory.events": "oom 1\noom_kill 4\n"},
            4,
        ),
        (  # v1 memory cgroups (this machine's layout, and older Slurm nodes'): it read None, every OOM kill
            # `process_lost`
            "4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
            {"memory/process_api/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"},
            5,
        ),
        (  # a parent's counter is not this process's: nothing readable at its own path -> unknown
            "4:memory:/process_api/abc\n0::/\n",
            {"memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 9\n"},
            None,
        ),
        ("garbage\n", {}, None),
    ],
)
def test_oom_kill_count_reads_the_own_memory_cgroup_in_each_layout(tmp_path, layout, files, expected):
    proc = tmp_path / "cgroup"
    proc.write_text(layout)
    root = tmp_path / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert procs.oom_kill_count(proc, root) == expected
    assert procs.oom_kill_count(tmp_path / "missing", root) is None


@pytest.mark.parametrize("pid", [2**31, 2**63, 10**20, 0, -5])
def test_a_pid_no_process_can_have_is_not_alive(pid):
    assert procs.pid_alive(pid, None) is False and procs.running(pid, None) is False
    assert procs.pid_alive(pid, 12345) is False
