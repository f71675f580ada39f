"""Restart in place (`ettr.inplace`): the generation protocol with fakes, and real torchrun jobs whose rank
fails and recovers without the other rank exiting, ending bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ettr.events import EventKind
from ettr.inplace import InPlaceConfig, InPlaceGaveUp
from ettr.inplace.generations import AgentGenerations, GenerationTimeout, StoreGenerations
from ettr.inplace.rendezvous import GenerationMovedOn, RendezvousTimeout, join, leave
from ettr.run_env import inplace_failed_path, inplace_next_path, inplace_ready_path


def test_the_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        InPlaceConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="rendezvous_timeout_s"):
        InPlaceConfig(rendezvous_timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        InPlaceConfig(backend="mpi")


def test_a_failed_generation_moves_the_store_counter_on_once() -> None:
    store = dist.HashStore()
    ranks = [StoreGenerations(store), StoreGenerations(store)]
    assert [g.first() for g in ranks] == [0, 0]
    found: list[int] = []
    threads = [
        threading.Thread(target=lambda g=g: found.append(g.after_failure(0, rank=0, error="x", timeout_s=30)))
        for g in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == [1, 1]  # both ranks reported generation 0's failure: one generation, not two
    assert ranks[0].moved_on(0) and not ranks[0].moved_on(1)
    assert StoreGenerations(store).first() == 1  # a process joining later joins the current one


def test_no_next_generation_in_time_gives_up() -> None:
    class Stuck(StoreGenerations):
        def moved_on(self, generation: int) -> bool:
            return False

    store = dist.HashStore()
    store.add("ettr/inplace/0/failed", 1)  # another rank already reported it (so this one does not move on)
    with pytest.raises(GenerationTimeout):
        Stuck(store).after_failure(0, rank=1, error="x", timeout_s=0.05)


def test_under_the_agent_a_generation_is_the_attempt_it_books(tmp_path: Path) -> None:
    generations = AgentGenerations(tmp_path, 3, pid=4242)
    assert generations.first() == 3
    generations.joined(3)
    assert inplace_ready_path(tmp_path, 3, 4242).exists()
    assert not generations.moved_on(3)

    def agent() -> None:  # sees the failure marker, books attempt 4, says so
        while not inplace_failed_path(tmp_path, 3, 4242).exists():
            time.sleep(0.001)
        inplace_next_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
        inplace_next_path(tmp_path).write_text(json.dumps({"attempt": 4, "replaced": []}))

    thread = threading.Thread(target=agent)
    thread.start()
    assert generations.after_failure(3, rank=1, error="ValueError: x", timeout_s=30) == 4
    thread.join()
    failed = json.loads(inplace_failed_path(tmp_path, 3, 4242).read_text())
    assert failed == {"rank": 1, "error": "ValueError: x", "own": True}
    assert generations.moved_on(3) and not generations.moved_on(4)
    inplace_next_path(tmp_path).write_text("{not json")  # a torn file is no answer
    assert generations.next_attempt() is None
    # nor is one nested 100,000 deep (it raised RecursionError into the training loop) or a 10 GB sparse one
    inplace_next_path(tmp_path).write_text('{"attempt": 5, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert generations.next_attempt() is None
    inplace_next_path(tmp_path).unlink()
    with open(inplace_next_path(tmp_path), "wb") as f:
        f.truncate(10 << 30)
    assert generations.next_attempt() is None


def test_the_benchmark_job_outwaits_its_own_fault() -> None:
    """`benchmarks/recovery.py`'s fault waits up to `--fail-wait-max-s` (120 s) for the standbys while the peer
    sits in an all-reduce: the job's process group gave up at a fixed 60 s, so on a loaded machine the ettr
    launchers' trials failed with a gloo timeout before the fault and measured nothing."""
    from ettr.testing.resilient_job import collective_timeout_s

    def args(*argv: str) -> Any:
        import argparse

        ns = argparse.Namespace(fail_after_s=0.0, fail_when=None, fail_wait_max_s=120.0)
        for a in argv:
            key, value = a.split("=")
            setattr(ns, key, float(value) if key != "fail_when" else value)
        return ns

    waits = args("fail_after_s=15", "fail_when=/tmp/x", "fail_wait_max_s=120")
    assert collective_timeout_s(waits) > 15 + 120
    assert collective_timeout_s(args("fail_after_s=15")) > 15
    assert collective_timeout_s(args()) >= 60  # no wait: the timeout it had


def test_a_generation_forms_only_with_every_rank_and_leaves_for_a_newer_one() -> None:
    store = dist.HashStore()
    with pytest.raises(RendezvousTimeout, match="1 of 2"):
        join(store, 0, rank=0, world_size=2, backend="gloo", timeout_s=0.05, collective_timeout_s=5,
             moved_on=lambda g: False)  # fmt: skip
    with pytest.raises(GenerationMovedOn):
        join(store, 1, rank=0, world_size=2, backend="gloo", timeout_s=30, collective_timeout_s=5,
             moved_on=lambda g: True)  # fmt: skip


def test_a_peer_that_dies_while_the_group_forms_is_given_up_on_within_the_rendezvous_timeout() -> None:
    """Rank 1 joined generation 0 and died before it connected: rank 0's group formation fails within the
    rendezvous bound, not the collective timeout (gloo's connect waits up to 5 x the group's timeout)."""
    store = dist.HashStore()
    dist.PrefixStore("ettr/inplace/0/", store).add("joined", 1)  # rank 1's join; it never connects
    raised: list[BaseException] = []

    def form() -> None:
        try:
            join(store, 0, rank=0, world_size=2, backend="gloo", timeout_s=0.5, collective_timeout_s=3600,
                 moved_on=lambda g: False)  # fmt: skip
        except RuntimeError as exc:
            raised.append(exc)

    forming = threading.Thread(target=form, daemon=True)
    forming.start()
    forming.join(timeout=300)  # 0.5 s with the bound; hours (3600 s x 5) without it
    assert not forming.is_alive() and raised
    assert not dist.is_initialized()


def test_leaving_releases_the_group_unless_something_holds_it(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    joined = join(store, 0, rank=0, world_size=1, backend="gloo", timeout_s=30, collective_timeout_s=5,
                  moved_on=lambda g: False)  # fmt: skip
    assert joined.wait_s >= 0 and dist.is_initialized()
    _, released = leave("gloo")
    assert released and not dist.is_initialized()
    join(store, 1, rank=0, world_size=1, backend="gloo", timeout_s=30, collective_timeout_s=5,
         moved_on=lambda g: False)  # fmt: skip
    kept = dist.distributed_c10d._get_default_group()  # what Generation.keep holding a DDP would do
    with caplog.at_level(logging.WARNING, logger="ettr"):
        _, released = leave("gloo")
    assert not released
    del kept
    # the warning says what holds it: here this test's own frame
    assert "test_leaving_releases_the_group_unless_something_holds_it (tests/test_inplace.py" in caplog.text


def test_leaving_waits_for_a_background_thread_of_the_generation_to_let_go() -> None:
    """An async checkpoint's persist that `train` did not wait for (no `with`) still holds the group when
    the generation is torn down; it fails and ends once the groups are gone, and the teardown waits for it."""

    def generation(index: int, until: threading.Event | None) -> threading.Thread:
        join(dist.HashStore(), index, rank=0, world_size=1, backend="gloo", timeout_s=30,
             collective_timeout_s=5, moved_on=lambda g: False)  # fmt: skip

        def persist(group: object) -> None:  # holds `group` until it ends
            while dist.is_initialized() or (until is not None and not until.wait(0.01)):
                time.sleep(0.01)

        thread = threading.Thread(target=persist, args=(dist.distributed_c10d._get_default_group(),))
        thread.start()
        return thread

    let_go = threading.Event()
    thread = generation(0, let_go)
    assert not leave("gloo")[1]  # not waited for: given up on at once
    let_go.set()
    thread.join()
    thread = generation(1, None)
    seconds, released = leave("gloo", release_wait_s=300)
    assert released and not thread.is_alive()


def test_a_module_imported_during_a_generation_does_not_keep_its_group() -> None:
    # ZeroRedundancyOptimizer's `_broadcast_object(..., group=dist.group.WORLD)`: a default argument taken
    # when torch.distributed.optim is first imported. TorchRec's set-up imports it inside a generation, and
    # the group it captured kept the demo's DLRM from restarting in place.
    import importlib

    import torch.distributed.optim.zero_redundancy_optimizer as zero

    from ettr.inplace.wrapper import IMPORT_BEFORE_FIRST_GROUP

    def generation(index: int) -> None:
        join(dist.HashStore(), index, rank=0, world_size=1, backend="gloo", timeout_s=30,
             collective_timeout_s=5, moved_on=lambda g: False)  # fmt: skip

    assert "torch.distributed.optim" in IMPORT_BEFORE_FIRST_GROUP  # imported before the first generation
    generation(0)
    from torch.distributed.optim import _apply_optimizer_in_backward  # noqa: F401  (as TorchRec does)

    assert leave("gloo")[1]
    generation(1)
    importlib.reload(zero)  # a first import during a generation, as without the wrapper's imports
    try:
        assert not leave("gloo")[1]
    finally:
        importlib.reload(zero)  # no group now: its default is None again
    assert zero._broadcast_object.__defaults__[0] is None


def test_teardown_forgets_what_torchrec_keeps_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # The survivor skipped DistributedModelParallel's one-time broadcast that its fresh replacement made,
    # and the demo's DLRM hung in its second generation: every rank must start it as a fresh process does.
    import importlib.util
    import re
    import types

    from ettr.inplace import libraries

    # The names are the installed TorchRec's (read from its sources: importing it takes seconds).
    spec = importlib.util.find_spec("torchrec")  # finds it without importing it
    if spec is None or spec.origin is None:
        pytest.skip("torchrec is not installed")
    for module, names in libraries.RESET_AT_TEARDOWN.items():
        source = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py").read_text()
        for name, initial in names.items():
            assert re.search(rf"^{name}: .* = {initial}$", source, re.MULTILINE), (module, name)

    validation = types.ModuleType("torchrec.distributed.collective_utils")
    validation._INITIALIZED = True  # type: ignore[attr-defined]
    validation._USE_COLLECTIVE_VALIDATION = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, validation.__name__, validation)
    monkeypatch.delitem(sys.modules, "torchrec.distributed.comm", raising=False)  # not imported: left alone
    assert libraries.forget() == ["torchrec.distributed.collective_utils._INITIALIZED"]
    assert validation._INITIALIZED is False  # type: ignore[attr-defined]
    assert libraries.forget() == []


# -- real jobs ------------------------------------------------------------------------------------------------


def _torchrun(tmp_path: Path, *job_args: str, max_restarts: int = 0, timeout_s: float = 600) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ETTR_MEMORY_DIR": str(tmp_path / "memory")}
    for name in [n for n in env if n.startswith("ETTR_") and n != "ETTR_MEMORY_DIR"]:
        env.pop(name)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), "-m", "ettr.testing.resilient_job",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--timings", str(tmp_path / "log.jsonl"), *job_args,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines() if line.strip()]


def _events_so_far(log: Path) -> list[dict[str, Any]]:
    """The job's log while it runs (a line still being written is left out)."""
    found = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


@pytest.mark.slow
def test_a_rank_that_raises_restarts_in_place_and_ends_bit_identical(
    tmp_path: Path, uninterrupted_resilient_digest: str
) -> None:
    proc = _torchrun(tmp_path, "--fault", "raise", "--fail-at", "17")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = _events(tmp_path)
    starts = {e["pid"] for e in events if e["ev"] == "start"}
    assert len(starts) == 2  # no process exited or started anew
    restored = [e for e in events if e["ev"] == "restored" and e["step"]]
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == [
        (0, 15, "memory"),
        (1, 15, "memory"),
    ]
    assert {e["digest"] for e in events if e["ev"] == "done"} == {uninterrupted_resilient_digest}
    assert not any((tmp_path / "memory").rglob("*.snap"))  # the completed job removed its copies


@pytest.mark.slow
def test_a_rank_that_dies_without_an_agent_to_replace_it_falls_back_to_a_process_restart(
    tmp_path: Path, uninterrupted_resilient_digest: str
) -> None:
    """Nobody replaces the dead rank: its peer gives up after the rendezvous timeout and exits, torchrun
    restarts both, and they restore from memory."""
    # 15 s, not less: the timeout bounds every generation's rendezvous, the restarted pair's first one too,
    # where one rank's start-up can trail the other's by seconds on a loaded machine (3 s failed at load 25)
    proc = _torchrun(
        tmp_path, "--fault", "kill", "--fail-at", "17", "--rendezvous-timeout-s", "15", max_restarts=1
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = _events(tmp_path)
    assert len({e["pid"] for e in events if e["ev"] == "start"}) == 4  # both ranks started again
    restored = [e for e in events if e["ev"] == "restored" and e["step"]]
    # the newest commit when rank 1 died: 15 if its persist had committed (an async save), else 10; memory
    # copies of it on both ranks unless the kill came between the commit and rank 1's copy
    assert len(restored) == 2 and len({(e["step"], e["source"]) for e in restored}) == 1
    assert restored[0]["step"] in (10, 15) and restored[0]["source"] in ("memory", "storage")
    assert {e["digest"] for e in events if e["ev"] == "done"} == {uninterrupted_resilient_digest}


@pytest.mark.slow
def test_kills_during_an_in_place_recovery_never_change_the_final_state(tmp_path: Path) -> None:
    """A few of benchmarks/recovery.py's kill trials (it runs 100): a rank SIGKILLed during the in-place
    recovery after a raise, or anywhere; the job ends with an uninterrupted run's parameters."""
    from ettr.testing.inplace_faults import InPlaceTrialRunner

    runner = InPlaceTrialRunner(tmp_path, seed=7)
    runner.calibrate()
    assert runner.recovery_s is not None
    # a kill aimed at the recovery can still miss it when this trial runs faster than the calibration did (the
    # job ends first: `not_fired`, a trial that tests nothing): aim again, a bounded number of times
    trials = [runner.run_trial(i, during_recovery=True) for i in range(2)]
    for i in range(2, 8):
        if sum(t.kill_landed != "not_fired" for t in trials) >= 2:
            break
        trials.append(runner.run_trial(i, during_recovery=True))
    trials.append(runner.run_trial(len(trials), during_recovery=False))
    assert all(t.completed and not t.bad for t in trials), trials
    assert sum(t.kill_landed != "not_fired" for t in trials if t.kill == "recovery") >= 2, trials


# -- under ettr run: ettr's agent books the restart in place and replaces a dead rank ----------------------------
def _ettr_run(tmp_path: Path, *job_args: str, timeout_s: float = 600) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    # No spares (tests/test_spares.py has them): the dead rank's replacement is forked at the failure, and
    # every process that runs the script is a worker of an attempt (the log's "start" lines count them).
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(tmp_path / "memory"), ETTR_SPARES="0")
    command = [
        sys.executable, "-m", "ettr", "run", "--run-dir", str(tmp_path / "run"), "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ettr.testing.resilient_job",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--timings", str(tmp_path / "log.jsonl"), *job_args,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def _report(run_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_under_ettr_run_a_failed_rank_is_recovered_in_place_and_booked_so(
    tmp_path: Path, uninterrupted_resilient_digest: str, fault: str
) -> None:
    """A SIGKILLed rank is replaced (a new process joins the survivor), a raise is restarted among the same
    processes; either way the surviving process lives on, the books show one failure recovered `in_place`,
    and the job ends bit-identical with nothing left in shared memory."""
    proc = _ettr_run(tmp_path, "--fault", fault, "--fail-at", "17")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 1 continues in place" in proc.stderr
    events = _events(tmp_path)
    starts = [e for e in events if e["ev"] == "start"]
    assert len(starts) == (3 if fault == "kill" else 2)  # only the dead rank started anew
    survivor = next(e["pid"] for e in starts if e["rank"] == 0)
    assert any(e["ev"] == "done" and e["pid"] == survivor for e in events)
    assert {e["digest"] for e in events if e["ev"] == "done"} == {uninterrupted_resilient_digest}
    report = _report(tmp_path / "run")
    assert report["num_failures"] == 1 and len(report["attempts"]) == 2
    assert [p["kind"] for p in report["ttr_parts"]] == ["in_place"]
    # a raise exits no process: no exit status is booked (before: "exit status 1 (rank 1): RuntimeError")
    assert report["attempts"][0]["exit_code"] == (137 if fault == "kill" else None)
    if fault == "raise":
        assert "attempt 0 failed: rank 1 raised an exception: RuntimeError: injected failure" in proc.stderr
    assert not any((tmp_path / "memory").iterdir())  # copies and the in-place store removed at the job's end
    assert [p["relaunch_path"] for p in report["ttr_parts"]] == ["forked" if fault == "kill" else "warm"]
    assert not (tmp_path / "run" / "agent" / "spares").exists()  # ETTR_SPARES=0: none forked


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["survivor", "replacement"])
def test_under_ettr_run_a_second_kill_while_the_group_re_forms_still_ends_bit_identical(
    tmp_path: Path, uninterrupted_resilient_digest: str, victim: str
) -> None:
    """Rank 1 is SIGKILLed; while ettr's agent has its replacement re-form the group with the survivor, the
    survivor (rank 0) or the replacement is SIGKILLed too. Whatever the second kill hits (before attempt 1
    trained: a process restart; after: in place again), the job completes bit-identical, and the
    books name the rank that died in the in-place attempt (the survivor recorded no start in it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    # No spares: the replacement must start after the fault (the test kills it as it re-forms the group)
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(tmp_path / "memory"), ETTR_SPARES="0")
    log = tmp_path / "log.jsonl"
    command = [
        sys.executable, "-m", "ettr", "run", "--run-dir", str(tmp_path / "run"), "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ettr.testing.resilient_job", "--ckpt-dir", str(tmp_path / "ckpt"), "--timings", str(log),
        "--fault", "kill", "--fail-at", "17",
    ]  # fmt: skip
    err = tmp_path / "stderr.txt"
    with err.open("w") as out:  # a file, not a pipe: the job's tracebacks never block it
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=out)
    killed: int | None = None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and killed is None and time.monotonic() < deadline:
            time.sleep(0.01)
            events = _events_so_far(log)
            fault = next((e for e in events if e["ev"] == "fault"), None)
            if fault is None:
                continue
            before = {e["pid"] for e in events if e["ts"] <= fault["ts"]}
            new = [e["pid"] for e in events if e["ev"] == "start" and e["pid"] not in before]
            if not new:  # the replacement has not reached the script's main yet
                continue
            survivor = next(e["pid"] for e in events if e["pid"] in before and e["rank"] == 0)
            killed = survivor if victim == "survivor" else new[0]
            try:
                os.kill(killed, 9)
            except ProcessLookupError:
                killed = None
                break
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    assert "attempt 1 continues in place" in stderr
    events = _events(tmp_path)
    assert {e["digest"] for e in events if e["ev"] == "done"} == {uninterrupted_resilient_digest}
    assert len([e for e in events if e["ev"] == "done"]) == 2
    report = _report(tmp_path / "run")
    if killed is not None:  # it landed before the job ended: a second failure, booked on its rank
        assert report["num_failures"] == 2, report["failures"]
        rank = 0 if victim == "survivor" else 1
        assert f"(rank {rank})" in report["failures"][1]["evidence"], report["failures"]
    assert not any((tmp_path / "memory").iterdir())


def test_zero_code_steps_are_counted_again_in_a_new_generation() -> None:
    """An unmodified script's steps come from its first optimizer; in a restart in place the survivor's next
    generation makes a new one (the first is gone): it is counted, from the generation's resume."""
    from ettr.bootstrap.hooks import StepCounter

    class Rec:
        explicit_steps, last_step = False, None

        def __init__(self) -> None:
            self.steps: list[int] = []

        def step(self, step: int, *, auto: bool = False) -> None:
            self.steps.append(step)

    class Optimizer:
        pass

    rec = Rec()
    counter = StepCounter(rec)  # type: ignore[arg-type]
    first = Optimizer()
    for _ in range(3):
        counter.on_step(first, (), {})
    del first  # the failed generation's optimizer is gone with its generation
    counter.new_generation()
    counter.resumed(2)  # the new generation restored the checkpoint of step 2
    second = Optimizer()
    counter.on_step(second, (), {})
    counter.on_step(second, (), {})
    assert rec.steps == [1, 2, 3, 3, 4]


def test_the_documented_names_resolve_after_a_bare_import_ettr():
    # docs/inplace.md annotates `def train(gen: ettr.inplace.Generation)` and docs/checkpointing.md uses
    # `ettr.checkpoint.lease(...)` after `import ettr`: they were AttributeErrors until something imported them.
    code = (
        "import sys, ettr\n"
        "assert 'ettr.inplace' not in sys.modules and 'torch' not in sys.modules\n"
        "def train(gen: ettr.inplace.Generation) -> None: ...\n"
        "assert callable(ettr.checkpoint.lease)\n"
        "try:\n"
        "    ettr.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print('ok', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.startswith("ok module 'ettr' has no attribute 'no_such_name'")


def _as_a_single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of 1 under torchrun's variables (a free port), with no ettr or elastic ones."""
    from ettr.supervisor.launch import free_port

    port = free_port()
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith("ETTR_") or n.startswith("TORCHELASTIC_")]:
        monkeypatch.delenv(name)


def test_a_preemption_exit_through_the_wrapper_warns_of_no_failed_generation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The checkpoint manager's preemption raises SystemExit(143) from inside `train`; the wrapper lets it pass
    # and tears the group down on the way out, while the exception's frames (DDP, the manager) still hold it.
    # That said "the failed generation's process group is still held" on every rank of a clean preemption.

    import ettr

    _as_a_single_rank(monkeypatch)

    def train(gen: Any) -> None:
        held = dist.distributed_c10d._get_default_group()  # as DDP and the checkpoint manager hold it
        assert held is not None
        raise SystemExit(143)

    with caplog.at_level(logging.WARNING, logger="ettr"), pytest.raises(SystemExit) as exited:
        ettr.resilient(train)()
    assert exited.value.code == 143
    assert "still held" not in caplog.text
    assert not dist.is_initialized()


def test_a_completed_run_destroys_its_groups_without_the_teardown_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once every rank has returned, nobody can be blocked on this rank's connections: the collection that
    # closes them early (and the group's destructor) was 0.3-0.4 s on the way out of each DLRM rank.

    import ettr
    from ettr.inplace import rendezvous

    _as_a_single_rank(monkeypatch)
    collections: list[int] = []
    monkeypatch.setattr(rendezvous.gc, "collect", lambda *a: collections.append(1) or 0)
    leaves: list[dict[str, Any]] = []
    original = rendezvous.leave

    def spy(backend: str, **kwargs: Any) -> tuple[float, bool]:
        leaves.append(kwargs)
        return original(backend, **kwargs)

    monkeypatch.setattr(rendezvous, "leave", spy)

    def train(gen: Any) -> int:
        held = dist.distributed_c10d._get_default_group()  # as a model would hold it
        assert held is not None
        return 7

    assert ettr.resilient(train)() == 7
    assert leaves == [{"exiting": True, "collect": False}]
    assert collections == [] and not dist.is_initialized()

    def preempted(gen: Any) -> None:
        raise SystemExit(
            143
        )  # not every rank returned: the teardown collects, so a blocked peer fails at once

    with pytest.raises(SystemExit):
        ettr.resilient(preempted)()
    assert leaves[-1] == {"exiting": True, "collect": True}
    assert collections and not dist.is_initialized()


def test_leaving_without_the_collection_still_destroys_the_groups() -> None:
    store = dist.HashStore()
    join(store, 0, rank=0, world_size=1, backend="gloo", timeout_s=30, collective_timeout_s=5,
         moved_on=lambda g: False)  # fmt: skip
    kept = dist.distributed_c10d._get_default_group()
    _, released = leave("gloo", exiting=True, collect=False)
    assert not released and not dist.is_initialized()  # destroyed; `kept` still refers to it
    del kept


@pytest.mark.parametrize(
    "named",
    ["{tmp}/theirs.store", "{root}/../theirs.store", "{root}/theirs.store", "inplace-1-0123456789ab.store"],
)
def test_a_rank_opens_no_file_store_but_one_rank_0_makes_in_its_private_root(
    tmp_path: Path, named: str
) -> None:
    # Anyone who can reach rank 0's TCP store can set the key that names the job's FileStore (torch's stores
    # take no credentials); every later generation re-forms through that file, so a path of theirs would
    # hand them the job's rendezvous. The other ranks opened whatever path the key held.
    import datetime

    from ettr.inplace.store import _PATH_KEY, StoreUnavailable, _local_file_store

    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    planted = named.format(tmp=tmp_path, root=root)
    bootstrap = dist.HashStore()
    bootstrap.set(_PATH_KEY, planted)
    with pytest.raises(StoreUnavailable, match="not a file rank 0 makes"):
        _local_file_store(bootstrap, rank=1, world_size=2, root=root, timeout=datetime.timedelta(seconds=5))
    assert not (tmp_path / "theirs.store").exists() and not (root / "theirs.store").exists()


def test_a_rank_opens_the_file_store_rank_0_made(tmp_path: Path) -> None:
    import datetime

    from ettr.inplace.store import _local_file_store

    root = tmp_path / "shm"
    bootstrap = dist.HashStore()
    made = _local_file_store(
        bootstrap, rank=0, world_size=1, root=root, timeout=datetime.timedelta(seconds=5)
    )
    try:
        other = _local_file_store(
            bootstrap, rank=1, world_size=2, root=root, timeout=datetime.timedelta(seconds=5)
        )
        other.store.set("k", "v")
        assert made.store.get("k") == b"v"
    finally:
        made.close()


def test_a_failed_store_hand_over_reaches_every_rank_at_once(tmp_path: Path) -> None:
    # Rank 1's part of the hand-over fails (here: the FileStore rank 0 names is not in rank 1's private root).
    # Before, rank 0 waited out its rendezvous timeout for rank 1 to open the file (then "not every rank opened
    # the job's FileStore in time"), and rank 2, which had opened it, waited as long in the rendezvous: the
    # job's fall-back to a process restart waited with them (measured, 20 s timeout: 20.02 s and 20.01 s).
    # Now rank 1 says why in the store and both raise with its reason (measured: 0.02 s, 0.07 s).
    import datetime

    from ettr.inplace.rendezvous import RendezvousAbandoned
    from ettr.inplace.store import StoreUnavailable, _local_file_store

    root, elsewhere = tmp_path / "shm", tmp_path / "other"
    for folder in (root, elsewhere):
        folder.mkdir(mode=0o700)
    bootstrap = dist.HashStore()
    timeout = datetime.timedelta(seconds=120)
    errors: dict[int, BaseException] = {}

    def rank(index: int) -> None:
        try:
            job = _local_file_store(
                bootstrap, rank=index, world_size=3, root=elsewhere if index == 1 else root, timeout=timeout
            )
            if index == 2:  # it opened the file: on to the rendezvous, where rank 1 never comes
                join(
                    job.store,
                    0,
                    rank=2,
                    world_size=3,
                    backend="gloo",
                    timeout_s=120,
                    collective_timeout_s=120,
                    moved_on=lambda generation: False,
                )
        except BaseException as exc:
            errors[index] = exc

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert "not a file rank 0 makes" in str(errors[1])
    assert isinstance(errors[0], StoreUnavailable) and "failed on rank 1" in str(errors[0])
    assert "not every rank opened" not in str(errors[0])  # not its timeout: rank 1's own reason
    assert isinstance(errors[2], RendezvousAbandoned) and "failed on rank 1" in str(errors[2])


def test_rank_0_whose_part_of_the_hand_over_fails_tells_the_others(tmp_path: Path) -> None:
    import datetime

    from ettr.inplace.store import StoreUnavailable, _local_file_store

    root = tmp_path / "shm"
    root.mkdir()
    root.chmod(0o777)  # writable by others: rank 0 refuses to keep the store there
    bootstrap = dist.HashStore()
    with pytest.raises(StoreUnavailable, match="not kept there"):
        _local_file_store(bootstrap, rank=0, world_size=2, root=root, timeout=datetime.timedelta(seconds=120))
    # rank 1, waiting for the name, reads why instead of waiting out its timeout
    with pytest.raises(
        StoreUnavailable, match="failed on rank 0: StoreUnavailable: the in-place store is not kept"
    ):
        _local_file_store(bootstrap, rank=1, world_size=2, root=root, timeout=datetime.timedelta(seconds=120))


def test_an_exception_after_the_processes_own_sigterm_handler_ran_is_no_failure_to_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A preemption's SIGTERM also ends the rank's DataLoader workers, and torch's SIGCHLD handler raises
    # "DataLoader worker ... is killed by signal: Terminated" over the script's handler's sys.exit(0): the
    # wrapper restarted in place and the rank waited for a next generation until SIGKILL (minGPT-ddp port).
    import ettr
    from ettr.bootstrap import outside_signals

    _as_a_single_rank(monkeypatch)
    calls: list[int] = []

    def train(gen: Any) -> None:
        calls.append(gen.index)
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated. ")

    monkeypatch.setattr(outside_signals, "_stops", [signal.SIGTERM])
    with pytest.raises(RuntimeError, match="killed by signal"):
        ettr.resilient(train)()
    assert calls == [0] and not dist.is_initialized()
    monkeypatch.setattr(outside_signals, "_stops", [])  # no stop: the same raise is restarted in place
    config = InPlaceConfig(max_restarts=1, rendezvous_timeout_s=30)
    with pytest.raises(InPlaceGaveUp):
        ettr.resilient(train, config=config)()
    assert calls == [0, 0, 1]


def test_a_train_that_makes_its_own_default_group_is_told_so_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A port that kept the script's `init_process_group` inside `train`: torch's "trying to initialize the
    # default process group twice!" was restarted in place max_restarts times, each failing the same way.
    import ettr

    _as_a_single_rank(monkeypatch)
    calls: list[int] = []

    def train(gen: Any) -> None:
        calls.append(gen.index)
        dist.init_process_group("gloo")

    with pytest.raises(InPlaceGaveUp, match="remove the script's own init_process_group"):
        ettr.resilient(train)()
    assert calls == [0] and not dist.is_initialized()


def test_a_rank_that_only_saw_a_peer_fail_says_so_not_that_it_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A SIGKILL of rank 1 under `ettr run`: rank 0's console line read "generation 0 failed on rank 0
    # (RuntimeError: ... Connection reset by peer ...)", naming the victim beside the agent's "(rank 1)".
    import ettr

    _as_a_single_rank(monkeypatch)
    errors = [RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), ValueError("own bug")]

    def train(gen: Any) -> None:
        if errors:
            raise errors.pop(0)

    config = InPlaceConfig(max_restarts=2, rendezvous_timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        ettr.resilient(train, config=config)()
    assert "generation 0: rank 0 lost a peer (RuntimeError: [pair.cc:537]" in caplog.text
    assert "generation 1 failed on rank 0 (ValueError: own bug)" in caplog.text


def test_a_rank_that_finished_sees_a_peer_that_died_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-place SIGKILL trials: a survivor whose `train` had returned waited in `_completed` for good for a
    # peer SIGKILLed after the recovery (no collective of its own failed; without an agent nobody moved the
    # generation on). Now it looks at the peers of its host and goes on to the next generation.
    import subprocess
    import sys

    from ettr import procs
    from ettr.inplace import rendezvous, wrapper
    from ettr.inplace.generations import StoreGenerations

    if procs.pid_space() is None:
        pytest.skip("no /proc here")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ticks = procs.start_ticks(child.pid)
    child.kill()
    child.wait()
    store = dist.HashStore()
    keys = rendezvous.generation_store(store, 0)
    rendezvous.announce(keys, 0)  # this process: alive
    keys.set("proc/2", f"{procs.pid_space()} {os.getpid()} x")  # alive too, start ticks unreadable
    keys.set("proc/3", "another-host pid:[1] 1 1")  # another host or container: never judged
    keys.set("proc/4", "garbage")
    assert rendezvous.dead_peer(keys, 0, 5) is None  # rank 1 said nothing yet
    keys.set("proc/1", f"{procs.pid_space()} {child.pid} {ticks}")
    assert rendezvous.dead_peer(keys, 0, 5) == 1
    assert rendezvous.dead_peer(keys, 1, 5) is None  # its own rank is not its peer
    rendezvous.returned(keys, 1)
    assert rendezvous.dead_peer(keys, 0, 5) is None  # a rank that returned from train may exit

    keys = rendezvous.generation_store(store, 1)  # the wait itself: rank 1 of 2 died, rank 0 finished
    keys.set("proc/1", f"{procs.pid_space()} {child.pid} {ticks}")
    monkeypatch.setattr(wrapper, "_DEAD_PEER_LOOK_S", 0.0)
    runner = object.__new__(wrapper._Runner)
    runner.rank, runner.world_size = 0, 2
    generations = StoreGenerations(store)
    assert runner._completed(store, 1, generations) is False


@pytest.mark.parametrize(
    "env",
    [
        {"ETTR_INPLACE_STORE": "tcp://127.0.0.1:²"},
        {"ETTR_INPLACE_STORE": "tcp://127.0.0.1:70000"},
        {"MASTER_PORT": "²"},
        {"MASTER_PORT": "0"},
        {"MASTER_PORT": "9" * 5000},
    ],
)
def test_a_port_that_is_no_port_is_store_unavailable(env: dict[str, str]) -> None:
    # '²'.isdigit() passed, then int() raised ValueError; 70000 reached TCPStore, which raised TypeError: neither
    # is the StoreUnavailable that open_job_store's callers are told of
    from ettr.inplace.store import StoreUnavailable, open_job_store

    with pytest.raises(StoreUnavailable, match="(?i)port"):
        open_job_store(rank=0, world_size=1, timeout_s=1.0, environ=env)


def test_under_a_supervisor_that_cannot_restart_in_place_a_train_that_returns_marks_the_end_of_training_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `ettr run` behind a shell wrapper (the real torchrun: one generation, `_once`): the DDP tutorial's
    # `@ettr.resilient` there recorded no end of training, so the restart policy had no evidence either.
    import types

    import ettr
    from ettr import runtime
    from ettr.constants import TRAINING_ENDED_MARK
    from ettr.inplace import wrapper
    from ettr.testing.recorder import SyncRecorder

    _as_a_single_rank(monkeypatch)
    supervised = types.SimpleNamespace(supervisor_pid=os.getpid(), attempt=2, run_dir="/nonexistent")
    monkeypatch.setattr(wrapper.RunEnv, "from_environ", staticmethod(lambda *a, **k: supervised))
    rec = SyncRecorder(rank=0)
    monkeypatch.setattr(runtime, "_default", rec)

    def train(gen: Any) -> int:
        rec.step(7)
        return gen.index

    assert ettr.resilient(train)() == 2  # one generation, numbered by the attempt: `_once`
    ended = [
        e.step for e in rec.events() if e.kind is EventKind.MARK and e.data["name"] == TRAINING_ENDED_MARK
    ]
    assert ended == [7]


def test_a_train_that_returns_marks_the_end_of_training_and_one_that_raises_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The restart policy's evidence that nothing is left to train (rule 4: a restart that reaches that step
    # is finishing, not stalling): said when `train` returns, never for a generation that raised.
    import ettr
    from ettr import runtime
    from ettr.constants import TRAINING_ENDED_MARK
    from ettr.testing.recorder import SyncRecorder

    _as_a_single_rank(monkeypatch)
    rec = SyncRecorder(rank=0)
    monkeypatch.setattr(runtime, "_default", rec)
    failures = [ValueError("own bug")]

    def train(gen: Any) -> None:
        rec.step(5 + gen.index)
        if failures:
            raise failures.pop(0)

    ettr.resilient(train, config=InPlaceConfig(max_restarts=1, rendezvous_timeout_s=30))()
    ended = [
        e.step for e in rec.events() if e.kind is EventKind.MARK and e.data["name"] == TRAINING_ENDED_MARK
    ]
    assert ended == [6]
