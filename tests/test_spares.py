"""Spares (`ettr.supervisor.spares`, `ettr.bootstrap.spare`): a replacement per local rank that ran the script's
start-up ahead and parked before `ettr.resilient`'s first rendezvous. The process side with a real FIFO, the
held recorder, and real `ettr run` jobs: a killed rank replaced by its spare (no event of it before its
promotion, the final state an uninterrupted run's), spares ended at a process restart and at the job's end, a
spare that dies while parked is no failure. (`ETTR_SPARES=0`: tests/test_inplace.py's jobs under `ettr run`.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ettr.bootstrap import spare
from ettr.ledger import read_run_events
from ettr.run_env import (
    ATTEMPT_STARTED_ENV,
    SPARE_ENV,
    spare_fifo_path,
    spare_parked_path,
    spares_dir,
)

# -- the process side, in this process ----------------------------------------------------------------------


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process as a held spare of a FIFO in `tmp_path` (the agent's write end open: `held.write_fd`)."""
    fifo = spare_fifo_path(tmp_path, 3, 1, 1)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo, 0o600)
    monkeypatch.setattr(spare, "_state", {})
    monkeypatch.setenv(SPARE_ENV, str(fifo))
    spare.hold(str(fifo))
    return fifo


def test_a_promoted_spare_takes_the_late_names_and_only_those(
    held: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    promoted: list[tuple[float, dict[str, Any]]] = []
    monkeypatch.setattr(
        "ettr.bootstrap.start.promote_spare", lambda at, fields: promoted.append((at, dict(fields)))
    )
    monkeypatch.setattr(spare, "IMPORT_AHEAD", ())
    monkeypatch.delenv(ATTEMPT_STARTED_ENV, raising=False)
    spare.note_origin("zygote", {"forked_at": 1.0})
    write_fd = os.open(held, os.O_RDWR)
    message = {"env": {ATTEMPT_STARTED_ENV: "123.5", "PATH": "/evil"}, "promoted_at": 124.0}
    os.write(write_fd, json.dumps(message).encode() + b"\n")
    path_before = os.environ.get("PATH")
    try:
        assert spare.is_held()
        assert spare.park() is True
    finally:
        os.close(write_fd)
    assert not spare.is_held()
    assert os.environ[ATTEMPT_STARTED_ENV] == "123.5" and os.environ.get("PATH") == path_before
    assert SPARE_ENV not in os.environ
    assert not held.exists() and not spare_parked_path(held).exists()  # read: it removed its hints
    [(at, fields)] = promoted
    assert at == 124.0 and fields["forked_at"] == 1.0 and fields["from"] == "zygote"
    assert fields["parked_at"] <= time.time()


def test_a_spare_whose_agent_closes_the_fifo_exits_without_writing_anything(tmp_path: Path) -> None:
    """EOF without a promotion: the spare exits 0 through `os._exit` (no exit handler, no exit marker)."""
    fifo = spare_fifo_path(tmp_path, 1, 0, 1)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo, 0o600)
    write_fd = os.open(fifo, os.O_RDWR)
    code = (
        "import atexit, sys\n"
        "from ettr.bootstrap import spare\n"
        f"atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').close())\n"
        f"spare.hold({str(fifo)!r})\n"
        "spare.park()\n"
        "sys.exit(5)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not spare_parked_path(fifo).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert json.loads(spare_parked_path(fifo).read_text())["pid"] == child.pid
        assert child.poll() is None  # parked: it waits
    finally:
        os.close(write_fd)
    assert child.wait(timeout=60) == 0
    assert not (tmp_path / "atexit").exists()


def test_a_held_recorder_writes_nothing_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ettr.runtime as runtime
    from ettr.events import EventKind

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        "ETTR_RUN_DIR": str(run_dir),
        "ETTR_JOB_ID": "j",
        "ETTR_ATTEMPT": "2",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    for name, value in {**env, SPARE_ENV: "x"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "_default", None)
    rec = runtime.get_recorder()
    try:
        assert not rec.enabled
        rec.mark("before", n=1)
        with rec.phase("preproc_creation"):
            pass
        assert not (run_dir / "ledger.db").exists() or not read_run_events(run_dir)
        monkeypatch.delenv(SPARE_ENV)
        monkeypatch.setattr(runtime, "process_start_time", lambda: 1000.0)
        runtime.release_held_recorder()
        assert rec.enabled and runtime.get_recorder() is rec
        rec.mark("after")
        rec.flush()
        events = read_run_events(run_dir)
        assert [e.kind for e in events] == [EventKind.PROCESS_START, EventKind.MARK]
        assert events[0].ts == 1000.0 and events[0].attempt == 2 and events[0].rank == 1
        assert events[1].data["name"] == "after"
    finally:
        rec.close()
        runtime.set_recorder(None)


def test_the_agent_uses_a_spare_only_where_its_environment_is_the_attempts() -> None:
    from ettr.supervisor.spares import Spare, Spares

    class Alive:
        pid = 1

        def poll(self) -> None:
            return None

    env = {"A": "1", "ETTR_ATTEMPT": "4"}
    made = Spare(rank=0, attempt=4, process=Alive(), env={**env, SPARE_ENV: "f"}, fifo=Path("f"), write_fd=-1)  # type: ignore[arg-type]
    assert Spares._misfit(made, 4, {**env, ATTEMPT_STARTED_ENV: "1.5"}) is None
    assert "for attempt 4" in (Spares._misfit(made, 5, env) or "")
    assert "differs" in (Spares._misfit(made, 4, {**env, "A": "2"}) or "")
    assert "B" in (Spares._misfit(made, 4, {**env, "B": "x"}) or "")


# -- real jobs under `ettr run` --------------------------------------------------------------------------------


class _Job:
    """`ettr run -- torchrun (2 ranks) -m ettr.testing.resilient_job ...` in the background; every process it
    starts carries `SPARES_TEST_TAG` in its environment (the zygote's too), so that none may be left."""

    def __init__(self, tmp_path: Path, *job_args: str, env: dict[str, str] | None = None) -> None:
        self.dir, self.run_dir, self.go = tmp_path, tmp_path / "run", tmp_path / "go"
        self.tag = f"spares-{os.getpid()}-{tmp_path.name}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
        environ.update(
            OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(tmp_path / "memory"), SPARES_TEST_TAG=self.tag
        )
        environ.update(env or {})
        command = [
            sys.executable, "-m", "ettr", "run", "--run-dir", str(self.run_dir), "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "ettr.testing.resilient_job", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--timings", str(tmp_path / "log.jsonl"), "--fail-when", str(self.go), "--fail-wait-max-s", "240",
            *job_args,
        ]  # fmt: skip
        self.stderr = tmp_path / "stderr.txt"
        with self.stderr.open("w") as out:
            self.proc = subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL, stderr=out)

    def parked(self, num: int = 2, timeout_s: float = 300) -> dict[int, int]:
        """{local rank: pid} of the parked spares, once `num` have parked."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = {}
            for path in spares_dir(self.run_dir).glob("*.parked"):
                try:
                    found[int(path.name.split("-rank-")[1].split("-")[0])] = json.loads(path.read_text())[
                        "pid"
                    ]
                except (OSError, ValueError, KeyError, IndexError):
                    continue
            if len(found) >= num:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {num} parked spares: {self.stderr.read_text()[-3000:]}")

    def log(self) -> list[dict[str, Any]]:
        path = self.dir / "log.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.strip().endswith("}")]

    def wait(self, timeout_s: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def left_behind(self) -> list[int]:
        """The processes still running that carry this job's tag (a moment after its end)."""
        found: list[int] = []
        for _ in range(40):
            found = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    environ = (entry / "environ").read_bytes()
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if f"SPARES_TEST_TAG={self.tag}".encode() in environ.split(b"\0") and state != "Z":
                    found.append(int(entry.name))
            if not found:
                return []
            time.sleep(0.1)
        return found

    def kill_all(self) -> None:
        for pid in self.left_behind():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _report(run_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_a_rank_killed_after_its_spare_parked_is_replaced_by_that_spare(
    tmp_path: Path, uninterrupted_resilient_digest: str
) -> None:
    """The replacement is the spare (its pid: started before the failure), nothing of it is in the books
    before its promotion, the spare of the rank that lived is ended, the final state is an uninterrupted
    run's, and nothing is left when the job ends."""
    job = _Job(tmp_path, "--fault", "kill", "--fail-at", "17")
    try:
        spares = job.parked()
        job.go.touch()
        assert job.wait() == 0, job.stderr.read_text()[-3000:]
        assert job.left_behind() == []
    finally:
        job.kill_all()
    stderr = job.stderr.read_text()
    assert "attempt 1 continues in place" in stderr and "spare parked" in stderr
    events = read_run_events(job.run_dir)
    attempt_1 = next(e for e in events if e.kind.name == "ATTEMPT_START" and e.attempt == 1)
    [started] = [e for e in events if e.kind.name == "PROCESS_START" and e.attempt == 1]
    assert started.rank == 1 and started.data["pid"] == spares[1]
    assert started.ts >= attempt_1.ts
    assert not [e for e in events if e.attempt >= 1 and e.ts < attempt_1.ts]  # nothing booked before it
    assert not [e for e in events if e.kind.name == "PROCESS_START" and e.data["pid"] == spares[0]]
    mark = next(e for e in events if e.kind.name == "MARK" and e.data.get("name") == "spare")
    assert mark.attempt == 1 and mark.rank == 1 and mark.data["parked_at"] < attempt_1.ts
    log = job.log()
    fault = next(e for e in log if e["ev"] == "fault")
    assert any(e["ev"] == "start" and e["pid"] == spares[1] and e["ts"] < fault["ts"] for e in log)
    assert {e["digest"] for e in log if e["ev"] == "done"} == {uninterrupted_resilient_digest}
    report = _report(job.run_dir)
    assert report["num_failures"] == 1
    [parts] = report["ttr_parts"]
    assert parts["kind"] == "in_place" and parts["relaunch_path"] == "spare"
    assert _gone(spares[0]) and not list(spares_dir(job.run_dir).glob("*.fifo"))


@pytest.mark.slow
def test_spares_end_at_a_process_restart_and_a_spare_that_dies_while_parked_is_no_failure(
    tmp_path: Path,
) -> None:
    """Both ranks SIGKILLed at once (no survivor: a process restart): the spares are gone before the restarted
    attempt trains. Its own spares are forked once it trained; one SIGKILLed while parked is forgotten: the
    job completes with that one failure only, and leaves nothing behind."""
    job = _Job(tmp_path, "--steps", "30", "--pause-at", "8")
    try:
        first = job.parked()
        workers = {e["rank"]: e["pid"] for e in job.log() if e["ev"] == "train" and e["generation"] == 0}
        os.kill(job.proc.pid, signal.SIGSTOP)  # the agent sees both dead at its next look: no survivor
        try:
            for pid in workers.values():
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        finally:
            os.kill(job.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 300
        while not any(e["ev"] == "train" and e["generation"] == 1 for e in job.log()):
            assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr.read_text()[-3000:]
            time.sleep(0.05)
        assert all(_gone(pid) for pid in first.values())  # ended before the restart's workers started
        second: dict[int, int] = {}
        while not second:  # the restarted attempt's spares, once it has trained
            found = job.parked()
            second = {r: p for r, p in found.items() if p not in first.values()}
        os.kill(second[1], signal.SIGKILL)
        time.sleep(1.5)  # the agent sees it gone (it looks each second)
        job.go.touch()
        assert job.wait() == 0, job.stderr.read_text()[-3000:]
        assert job.left_behind() == []
    finally:
        job.kill_all()
    report = _report(job.run_dir)
    assert report["num_failures"] == 1 and len(report["attempts"]) == 2
    assert report["attempts"][1]["outcome"] == "completed"
    events = read_run_events(job.run_dir)
    started = {e.data["pid"] for e in events if e.kind.name == "PROCESS_START"}
    assert not started & ({*first.values(), *second.values()})  # no spare was ever a process of an attempt
