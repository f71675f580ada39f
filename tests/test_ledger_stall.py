"""A real PostgreSQL server that stalls: every process of it SIGSTOPped (TCP stays up, nothing answers).

Keepalives and `tcp_user_timeout` do not fire (the kernel still acknowledges) and the server's
`statement_timeout` cannot run, so only ettr's client-side watchdog bounds the calls. A training process
that finishes during the stall must exit anyway, spilling what it could not deliver; once the server
answers again, every event is on it exactly once. No timing is asserted: only that the exit happens at
all while the server is still stopped (within a generous timeout), and the counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from ettr.events import Event, EventKind
from ettr.ledger.url import open_for_run, open_url

ETTR = [sys.executable, "-m", "ettr.cli"]
EXIT_WAIT_S = 180.0  # generous: the bound is seconds; without it the process waits for the server forever

# A training process as `ettr run` makes it (ETTR_* env, ETTR_LEDGER): N steps before the stall, told to go
# on by a line on stdin once the server is stopped, M steps during it, then an ordinary exit.
_WRITER = textwrap.dedent(
    """
    import sys
    import ettr
    before, during = int(sys.argv[1]), int(sys.argv[2])
    for n in range(1, before + 1):
        ettr.step(n)
    ettr.get_recorder().flush(timeout_s=60)
    print("flushed", flush=True)
    sys.stdin.readline()
    for n in range(before + 1, before + during + 1):
        ettr.step(n)
    print("done", flush=True)
    """
)


def _steps(url: str, job_id: str) -> Counter[int]:
    ledger = open_url(url, job_id=job_id)
    try:
        return Counter(e.step for e in ledger.read() if e.kind is EventKind.STEP and e.step is not None)
    finally:
        ledger.close()


def _num_steps_so_far(url: str, job_id: str) -> int:
    try:
        return sum(_steps(url, job_id).values())
    except Exception:  # the job is not on the server yet
        return 0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return {**env, **extra}


def test_a_training_process_exits_during_a_stall_and_nothing_is_lost(private_postgres, tmp_path):
    server, job_id, run_dir = private_postgres, "stall", tmp_path / "run"
    before, during = 500, 2500
    # The supervisor's side: creates the job and adopts the spill files of writers that died.
    books = open_for_run(server.url, job_id=job_id, run_dir=run_dir, supervisor=True, retry_interval_s=0.5)
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = _env(ETTR_RUN_DIR=str(run_dir), ETTR_JOB_ID=job_id, ETTR_ATTEMPT="0", ETTR_LEDGER=server.url)
    writer = subprocess.Popen(
        [sys.executable, str(script), str(before), str(during)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "flushed", writer.communicate(timeout=60)
        assert sum(_steps(server.url, job_id).values()) == before
        server.pause()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        try:
            out, err = writer.communicate(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the training process did not exit while the server was stalled")
        assert writer.returncode == 0, err
        assert "done" in out
        spilled = list((run_dir / "ledger-spill").glob("*.jsonl"))
        assert spilled, f"the stalled server's events were not spilled: {err[-2000:]}"
        assert "could not be written" not in err, err[-2000:]
    finally:
        server.resume()
        if writer.poll() is None:
            writer.kill()
    books.close(drain_timeout_s=120)  # the supervisor delivers the orphaned spill file
    steps = _steps(server.url, job_id)
    assert sorted(steps) == list(range(1, before + during + 1))
    assert set(steps.values()) == {1}, "an event was stored twice"
    assert not list((run_dir / "ledger-spill").glob("*.jsonl")), "spill files left after delivery"


def test_calls_on_a_stalled_server_fail_instead_of_waiting_for_it(private_postgres, tmp_path):
    """Each kind of call (connect, append, read, the fleet's readers, close) returns while the server is
    stopped: a `LedgerError` saying it did not answer, never a wait for the server to come back."""
    from ettr.ledger.base import LedgerError
    from ettr.ledger.postgres import PostgresLedger, list_jobs, read_jobs_marked, read_summaries

    def step_events(n: int) -> list[Event]:
        return [Event(EventKind.STEP, time.time(), 0, 0, step=i) for i in range(1, n + 1)]

    server = private_postgres
    ledger = PostgresLedger(server.url, job_id="j", create=True, call_timeout_s=2.0)
    ledger.append(step_events(3))
    server.pause()
    try:
        calls = {
            "append": lambda: ledger.append(step_events(3)),
            "read": ledger.read,
            "last_activity": lambda: ledger.last_activity(0),
            "connect": lambda: PostgresLedger(server.url, job_id="j"),
            "list_jobs": lambda: list_jobs(server.url),
            "read_summaries": lambda: read_summaries(server.url),
            "read_jobs_marked": lambda: list(read_jobs_marked(server.url, ["j"])),
        }
        failed = {}
        for name, call in calls.items():
            with pytest.raises(LedgerError) as caught:
                call()
            failed[name] = str(caught.value)
        assert all("\n" not in message for message in failed.values()), failed
        assert "no answer within 2 s" in failed["append"]
        ledger.close()
    finally:
        server.resume()
    ledger = PostgresLedger(server.url, job_id="j")
    assert sum(1 for e in ledger.read() if e.kind is EventKind.STEP) == 3  # the cut append stored nothing
    ledger.close()


@pytest.mark.slow
def test_ettr_run_through_a_stall_delivers_every_step_once(private_postgres, tmp_path):
    """The probe's case end to end: `ettr run --ledger` with a trainer that finishes while the server is
    stopped. The trainer exits anyway; after SIGCONT the supervisor delivers every step exactly once."""
    server, job_id, run_dir = private_postgres, "stall-run", tmp_path / "run"
    num_steps = 3000
    train = tmp_path / "train.py"
    pid_file = tmp_path / "trainer.pid"
    train.write_text(
        textwrap.dedent(
            f"""
            import os, time, torch
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(32, 8)
            for i in range({num_steps}):
                opt.zero_grad()
                ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
                opt.step()
                time.sleep(0.004)
            """
        )
    )
    command = [*ETTR, "run", "--run-dir", str(run_dir), "--job-id", job_id, "--ledger", server.url, "--",
               sys.executable, str(train)]  # fmt: skip
    job = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while _num_steps_so_far(server.url, job_id) < 50:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job never reached step 50"
            time.sleep(0.2)
        server.pause()
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + EXIT_WAIT_S
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            if time.monotonic() > deadline:
                pytest.fail("the trainer did not exit while the server was stalled")
            time.sleep(0.5)
        server.resume()
        out, err = job.communicate(timeout=300)
    finally:
        server.resume()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    steps = _steps(server.url, job_id)
    assert sorted(steps) == list(range(1, num_steps + 1)), (len(steps), err[-3000:])
    assert set(steps.values()) == {1}
    assert not list((run_dir / "ledger-spill").glob("*.jsonl"))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"
