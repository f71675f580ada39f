"""SIGKILL trials of a job that restarts in place: is the final state ever not an uninterrupted run's?

Each trial runs `ettr.testing.resilient_job` on two ranks, forked from a forkserver that has torch imported
(milliseconds to start, not seconds), with a launcher of its own playing torchrun's part: when a rank dies
its peer gives up on it (within its rendezvous timeout, then it exits; one that does not is killed and
counted in `hung`) and the launcher starts both again, up to `max_restarts` times. In every trial rank `fail_rank`
raises after step `fail_at` — an exception the process survives, so both ranks restart in place and restore
from memory — and the trial SIGKILLs a random rank at a random moment: during that in-place recovery (from
the raise until the ranks train again), or anywhere in the run. The job must end with the parameters an
uninterrupted run ends with (`bad`), through whatever mix of in-place restarts, process restarts, memory
and storage restores the kill caused.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettr.supervisor.launch import free_port


@dataclass(frozen=True)
class InPlaceTrial:
    """What one trial did and found."""

    index: int
    kill: str
    """Where the SIGKILL was aimed: `recovery` (between the raise and training again) or `anywhere`."""
    killed_rank: int
    kill_landed: str
    """Where it landed: `before_raise`, `recovery`, `after_recovery`, `not_fired` (the job ended first)."""
    launches: int
    """How many times the launcher started the ranks (1: no process restart)."""
    completed: bool
    bad: bool
    """The job completed with parameters other than an uninterrupted run's."""
    restored_from: tuple[str, ...]
    """Where each restore after the raise read the state (per rank and generation)."""
    detail: str = ""


def _rank_main(argv: list[str], env: dict[str, str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import faulthandler

    os.environ.update(env)
    log = os.open(env["TRIAL_STDERR"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a survivor that did not give up was
    from ettr.testing.resilient_job import main

    os._exit(main(argv))


def _events(log: Path) -> list[dict[str, Any]]:
    """The job's log so far (a line still being written is left out)."""
    found = []
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def _recovery_span(events: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """When the raise came, and when a rank first trained after its restore that followed (None: not seen)."""
    fault = next((e["ts"] for e in events if e["ev"] == "fault"), None)
    if fault is None:
        return None, None
    restored = min((e["ts"] for e in events if e["ev"] == "restored" and e["ts"] > fault), default=None)
    if restored is None:
        return fault, None
    return fault, min((e["ts"] for e in events if e["ev"] == "step" and e["ts"] > restored), default=None)


class InPlaceTrialRunner:
    """Runs in-place SIGKILL trials under `workdir` (which it owns).

    Args:
        workdir: scratch directory (checkpoint roots, memory copies, logs).
        steps, every, fail_at, fail_rank: the job (`resilient_job`'s flags).
        max_restarts: process restarts the launcher allows per trial.
        rendezvous_timeout_s: how long a surviving rank waits for a killed peer before it exits.
        seed: seeds the kill schedule.
        memory_interval: the job keeps memory-tier commits (`resilient_job --memory-interval`; None: off).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        steps: int = 30,
        every: int = 5,
        fail_at: int = 12,
        fail_rank: int = 1,
        max_restarts: int = 4,
        rendezvous_timeout_s: float = 4.0,
        seed: int = 0,
        memory_interval: str | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.steps, self.every, self.fail_at, self.fail_rank = steps, every, fail_at, fail_rank
        self.max_restarts, self.rendezvous_timeout_s = max_restarts, rendezvous_timeout_s
        self._rng = random.Random(seed)
        self.memory_interval = memory_interval
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(
            ["ettr.testing.resilient_job", "torch.nn.parallel", "torch._dynamo"]
        )
        self.grace_s = 30.0
        """After a rank died, how long past `rendezvous_timeout_s` its peers may take to give up and exit
        before they count as hung (`hung`) and are killed."""
        self.hung = 0
        """Launches whose surviving rank outlived a dead peer by more than the rendezvous timeout and grace."""
        self._hung_in: set[str] = set()  # trials (directory names) with a hung survivor: kept for a look
        self.reference: str | None = None
        self.run_s: float | None = None
        """Wall time of a run with the raise and no kill, from the first start to the last step."""
        self.recovery_s: float | None = None
        """In that run, from the raise until a rank trained again: the window a `recovery` kill aims at."""

    def _argv(self, trial: Path, fault: str) -> list[str]:
        return [
            "--ckpt-dir", str(trial / "ckpt"), "--timings", str(trial / "log.jsonl"), "--steps", str(self.steps),
            "--every", str(self.every), "--fault", fault, "--fail-at", str(self.fail_at),
            "--fail-rank", str(self.fail_rank), "--hidden", "32", "--step-s", "0.01",
            "--rendezvous-timeout-s", f"{self.rendezvous_timeout_s:g}",
            *(("--memory-interval", self.memory_interval) if self.memory_interval else ()),
        ]  # fmt: skip

    def _launch(self, trial: Path, fault: str) -> list[Any]:
        port = free_port()
        procs = []
        for rank in range(2):
            env = {
                "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                "ETTR_MEMORY_DIR": str(trial / "memory"), "TRIAL_STDERR": str(trial / "stderr.log"),
            }  # fmt: skip
            process = self._context.Process(target=_rank_main, args=(self._argv(trial, fault), env))
            process.start()
            procs.append(process)
        return procs

    def _run_job(self, trial: Path, fault: str, kill: tuple[str, int, float] | None) -> tuple[int, bool, str]:
        """Run the job to its end (relaunching after a death); returns (launches, completed, kill landed)."""
        log = trial / "log.jsonl"
        launches, landed = 0, "not_fired"
        fire_at: float | None = None
        while launches <= self.max_restarts:
            procs = self._launch(trial, fault)
            launches += 1
            died: float | None = None
            deadline = time.monotonic() + 300
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if died is None and any(p.exitcode is not None and p.exitcode != 0 for p in procs):
                    died = time.monotonic()  # its peers give up on it within their rendezvous timeout
                if died is not None and time.monotonic() > died + self.rendezvous_timeout_s + self.grace_s:
                    self.hung += 1  # a survivor that did not give up: ended as torchrun would end it
                    self._hung_in.add(trial.name)
                    for p in procs:
                        if p.is_alive() and p.pid is not None:
                            os.kill(p.pid, signal.SIGUSR1)  # its stacks, into the trial's stderr.log
                    time.sleep(1.0)
                    break
                if kill is not None and landed == "not_fired":
                    where, rank, delay_s = kill
                    events = _events(log)
                    origin = next((e["ts"] for e in events if e["ev"] == "fault"), None) if where == "recovery" else (
                        min((e["ts"] for e in events if e["ev"] == "step"), default=None)
                    )  # fmt: skip
                    if origin is not None and fire_at is None:
                        fire_at = origin + delay_s
                    if fire_at is not None and time.time() >= fire_at and procs[rank].is_alive():
                        os.kill(procs[rank].pid, signal.SIGKILL)
                        landed = self._where(_events(log), time.time())
                time.sleep(0.002)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes):
                return launches, True, landed
        return launches, False, landed

    def _where(self, events: list[dict[str, Any]], ts: float) -> str:
        fault, back = _recovery_span(events)
        if fault is None or ts < fault:
            return "before_raise"
        return "recovery" if back is None or ts < back else "after_recovery"

    def calibrate(self) -> float:
        """An uninterrupted run (its final digest is the reference) and one with the raise alone (its
        length bounds the random kills)."""
        plain = self.workdir / "reference"
        shutil.rmtree(plain, ignore_errors=True)
        plain.mkdir(parents=True)
        launches, completed, _ = self._run_job(plain, "none", None)
        digests = {e["digest"] for e in _events(plain / "log.jsonl") if e["ev"] == "done"}
        if not completed or len(digests) != 1:
            raise RuntimeError(f"the uninterrupted reference run failed (see {plain}/stderr.log)")
        self.reference = digests.pop()
        raised = self.workdir / "raise-only"
        shutil.rmtree(raised, ignore_errors=True)
        raised.mkdir(parents=True)
        self._run_job(raised, "raise", None)
        events = _events(raised / "log.jsonl")
        steps = [e["ts"] for e in events if e["ev"] == "step"]
        self.run_s = max(0.5, max(steps) - min(steps)) if steps else 5.0
        fault, back = _recovery_span(events)
        self.recovery_s = None if fault is None or back is None else max(0.01, back - fault)
        return self.run_s

    def run_trial(self, index: int, *, during_recovery: bool) -> InPlaceTrial:
        if self.reference is None or self.run_s is None:
            self.calibrate()
        assert self.run_s is not None
        trial = self.workdir / f"trial{index:04d}"
        shutil.rmtree(trial, ignore_errors=True)
        trial.mkdir(parents=True)
        rank = self._rng.randrange(2)
        # a recovery kill aims inside the window the raise-only run took (not a fixed span a fast recovery and
        # the rest of the job can end within, which would leave the kill unfired)
        window_s = self.recovery_s if self.recovery_s is not None else 0.5
        delay_s = self._rng.uniform(0.0, window_s) if during_recovery else self._rng.uniform(0.0, self.run_s)
        where = "recovery" if during_recovery else "anywhere"
        launches, completed, landed = self._run_job(trial, "raise", (where, rank, delay_s))
        events = _events(trial / "log.jsonl")
        digests = {e["digest"] for e in events if e["ev"] == "done"}
        bad = completed and digests != {self.reference}
        fault = next((e["ts"] for e in events if e["ev"] == "fault"), float("inf"))
        sources = tuple(
            str(e.get("source")) + ("-tier" if e.get("tier") == "memory" else "")  # a memory-tier commit
            for e in events
            if e["ev"] == "restored" and e["ts"] > fault
        )
        detail = "" if not bad else f"final digests {sorted(digests)} != reference {self.reference}"
        if not completed:
            detail = f"did not complete in {launches} launches (see {trial}/stderr.log)"
        elif bad:
            detail += f" (its logs: {trial})"
        elif trial.name in self._hung_in:
            detail = f"a survivor did not give up on its dead peer (its stacks: {trial}/stderr.log)"
        else:
            shutil.rmtree(trial, ignore_errors=True)
        return InPlaceTrial(index, where, rank, landed, launches, completed, bad, sources, detail)
