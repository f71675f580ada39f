"""ettr's own torchrun agent: a torchrun command line read into a worker spec, the fallbacks, the workers'
environment (`ettr.supervisor.agent`). Pure and fast; the real restart is in test_agent_restart.py."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from ettr.supervisor import agent
from ettr.supervisor.agent import PER_ATTEMPT_NAMES, WorkerSpec, parse, worker_env

PY = os.path.abspath(sys.executable)
RUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {"PATH": os.environ.get("PATH", "")}


def test_a_standalone_command_becomes_n_workers_running_python_u_script() -> None:
    spec = parse(
        [*RUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "job.py", "--lr", "1"], ENV
    )
    assert spec == WorkerSpec(nproc=2, argv=(PY, "-u", "job.py", "--lr", "1"))


@pytest.mark.parametrize(
    ("options", "argv_tail", "fields"),
    [
        (["--nnodes", "1", "--nproc_per_node=4"], ["t.py"], {"nproc": 4}),
        (["--nnodes=1:1", "--node-rank", "0", "--master-addr", "localhost"], ["t.py"], {"master_addr": "localhost"}),
        (["--standalone", "-m"], ["pkg.train", "x"], {}),
        (["--standalone", "--no-python"], ["./train.sh", "x"], {}),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "j7"], ["t.py"], {"run_id": "j7"}),
        (["--standalone", "--role", "trainer", "--monitor-interval", "1", "--start-method", "fork"], ["t.py"], {"role": "trainer"}),
    ],
)  # fmt: skip
def test_the_supported_forms(options: list[str], argv_tail: list[str], fields: dict) -> None:
    spec = parse([*RUN, *options, *argv_tail], ENV)
    assert isinstance(spec, WorkerSpec), spec
    if "--no-python" in options:
        assert spec.argv == tuple(argv_tail)
    elif "-m" in options:
        assert spec.argv == (PY, "-u", "-m", *argv_tail)
    else:
        assert spec.argv == (PY, "-u", *argv_tail)
    for name, value in fields.items():
        assert getattr(spec, name) == value


@pytest.mark.parametrize(
    "command",
    [
        [*RUN, "--nnodes", "2", "--nproc-per-node", "2", "t.py"],
        [*RUN, "--nnodes", "1:2", "t.py"],
        [*RUN, "--standalone", "--nproc-per-node", "gpu", "t.py"],
        [*RUN, "--standalone", "--tee", "3", "t.py"],
        [*RUN, "--standalone", "--redirects", "3", "t.py"],
        [*RUN, "--standalone", "--log-dir", "/tmp/x", "t.py"],
        [*RUN, "--standalone", "--local-ranks-filter", "0", "t.py"],
        [*RUN, "--standalone", "--run-path", "t.py"],
        [*RUN, "--standalone", "--virtual-local-rank", "t.py"],
        [*RUN, "--nnodes", "1", "--rdzv-endpoint", "node7:29500", "t.py"],
        [*RUN, "--nnodes", "1", "--master-addr", "10.1.2.3", "t.py"],
        [*RUN, "--nnodes", "1", "--node-rank", "1", "t.py"],
        [*RUN, "--standalone", "--rdzv-conf", "timeout=5", "t.py"],
        [*RUN, "--standalone", "--no-python", "-m", "pkg"],
        [*RUN, "--standalone", "--some-future-flag", "1", "t.py"],
        [*RUN, "--standalone"],
        [sys.executable, "-X", "dev", "-m", "torch.distributed.run", "--standalone", "t.py"],
        [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2", "t.py"],
        [sys.executable, "t.py"],
    ],
)
def test_anything_not_reproduced_exactly_keeps_the_real_torchrun(command: list[str]) -> None:
    reason = parse(command, ENV)
    assert isinstance(reason, str) and reason


def test_the_torchrun_script_gives_its_interpreter_and_python_exec_overrides_it(tmp_path: Path) -> None:
    script = tmp_path / "torchrun"
    script.write_text(f"#!{PY}\nimport sys\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": str(tmp_path)}
    assert parse(["torchrun", "--standalone", "t.py"], env) == WorkerSpec(nproc=1, argv=(PY, "-u", "t.py"))
    spec = parse(["torchrun", "--standalone", "t.py"], {**env, "PYTHON_EXEC": "/opt/py"})
    assert isinstance(spec, WorkerSpec) and spec.argv[0] == "/opt/py"
    script.write_text("#!/usr/bin/env python\n")  # which python that is depends on PATH: not known for sure
    assert isinstance(parse(["torchrun", "--standalone", "t.py"], env), str)


def test_ettr_agent_torchrun_forces_the_real_torchrun() -> None:
    assert agent.forced_torchrun({"ETTR_AGENT": "torchrun"})
    assert not agent.forced_torchrun({})
    assert not agent.forced_torchrun({"ETTR_AGENT": "ettr"})


def test_a_link_or_fifo_planted_where_a_worker_writes_its_error_record_is_removed_first(
    tmp_path: Path,
) -> None:
    # torch's errors.record writes TORCHELASTIC_ERROR_FILE with open(file, "w"): through a planted symlink
    # (the target overwritten with the worker's traceback) or into a FIFO (the failing worker held for ever)
    from ettr.untrusted import SymlinkRefused

    victim = tmp_path / "victim"
    victim.write_text("mine")
    planted = agent.error_file(tmp_path / "run", 3, 0)
    planted.parent.mkdir(parents=True)
    planted.symlink_to(victim)
    fifo = agent.error_file(tmp_path / "run", 3, 1)
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for rank in (0, 1, 2):
        path = agent.fresh_error_file(tmp_path / "run", 3, rank)
        assert path == agent.error_file(tmp_path / "run", 3, rank) and path.parent.is_dir()
        assert not os.path.lexists(path)
    assert victim.read_text() == "mine"
    (tmp_path / "run" / "agent" / "attempt-4").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(SymlinkRefused):
        agent.fresh_error_file(tmp_path / "run", 4, 0)


def _env(spec: WorkerSpec, rank: int, *, port: int, restart: int, inherited: dict | None = None) -> dict:
    base = {"PATH": "/bin", "ETTR_ATTEMPT": str(restart)}
    return worker_env(
        spec, base, local_rank=rank, port=port, restart_count=restart, max_restarts=3,
        error_file=f"/run/agent/attempt-{restart}/{rank}/error.json", inherited=inherited or {},
    )  # fmt: skip


def test_the_workers_get_torchruns_environment() -> None:
    spec = WorkerSpec(nproc=2, argv=(PY, "-u", "t.py"), run_id="j1", role="trainer")
    env = _env(spec, 1, port=4242, restart=1)
    expected = {
        "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1", "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "j1", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1", "PATH": "/bin",
        "TORCHELASTIC_ERROR_FILE": "/run/agent/attempt-1/1/error.json", "ETTR_ATTEMPT": "1",
    }  # fmt: skip
    assert env == expected


def test_omp_num_threads_is_set_only_as_torchrun_sets_it() -> None:
    many, one = WorkerSpec(nproc=2, argv=("x",)), WorkerSpec(nproc=1, argv=("x",))
    assert "OMP_NUM_THREADS" not in _env(one, 0, port=1, restart=0)
    kept = worker_env(
        many, {"OMP_NUM_THREADS": "8"}, local_rank=0, port=1, restart_count=0, max_restarts=0,
        error_file="e", inherited={"OMP_NUM_THREADS": "8"},
    )  # fmt: skip
    assert kept["OMP_NUM_THREADS"] == "8"


def test_from_one_attempt_to_the_next_only_the_per_attempt_names_change() -> None:
    """What a warm standby may receive late: everything else it saw at start-up is the next attempt's."""
    spec = WorkerSpec(nproc=2, argv=(PY, "-u", "t.py"))
    for rank in (0, 1):
        first, second = _env(spec, rank, port=1111, restart=0), _env(spec, rank, port=2222, restart=1)
        changed = {k for k in first.keys() | second.keys() if first.get(k) != second.get(k)}
        assert changed - {k for k in changed if k.startswith("ETTR_")} == PER_ATTEMPT_NAMES


class FakeWorker:
    """An AttemptProcess stand-in: `code` is what poll() returns; signals are recorded (SIGTERM/SIGKILL
    end it with -signal)."""

    def __init__(self, pid: int, *, stops_on: tuple[int, ...] = (15, 9)) -> None:
        self.pid, self.code, self.signals, self._stops_on = pid, None, [], stops_on

    def poll(self):
        return self.code

    def signal_tree(self, sig, *, include_command=True):
        self.signals.append(int(sig))
        if int(sig) in self._stops_on and self.code is None:
            self.code = -int(sig)
        return [self.pid]

    def stderr_tail(self, num_lines=20):
        return [f"tail of {self.pid}"]


def test_the_first_failed_worker_is_the_attempts_failure_and_the_rest_are_stopped_after_the_flush() -> None:
    from ettr.supervisor.workers import WorkerGroup

    workers = [FakeWorker(10), FakeWorker(11), FakeWorker(12)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    assert group.poll() is None and group.failed_rank is None
    workers[1].code = 3
    assert group.poll() is None  # SIGTERM to ranks 0 and 2 at once (no flush window here) ...
    assert group.poll() == 3  # ... and once they are gone, the attempt's status is rank 1's
    assert group.failed_rank == 1 and group.failed_at is not None
    assert workers[0].signals == [15] and workers[2].signals == [15] and workers[1].signals == []
    assert group.stderr_tail() == ["tail of 11"]


def test_of_workers_seen_ended_together_the_one_a_signal_killed_is_the_failure() -> None:
    """A rank SIGKILLed (the OOM killer, an operator) makes its peers' next collective fail: when one poll
    finds both ended, the killed rank is the cause, not the lower rank that exited 1 after it."""
    from ettr.supervisor.workers import WorkerGroup

    workers = [FakeWorker(50), FakeWorker(51)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    workers[0].code, workers[1].code = 1, -9
    assert group.poll() == -9 and group.failed_rank == 1


def test_workers_that_ignore_sigterm_get_sigkill_after_the_grace() -> None:
    from ettr.supervisor.workers import WorkerGroup

    stubborn = FakeWorker(20, stops_on=(9,))
    failed = FakeWorker(21)
    group = WorkerGroup([stubborn, failed], flush_s=0.0, teardown_grace_s=0.05)
    failed.code = 1
    assert group.poll() is None and stubborn.signals == [15]
    time.sleep(0.1)  # the grace is wall-clock time
    assert group.poll() is None and stubborn.signals == [15, 9]
    assert group.poll() == 1


def test_after_a_forwarded_signal_the_group_sends_no_sigterm_of_its_own() -> None:
    """A preempted job's ranks save on the supervisor's SIGTERM; a second one would interrupt the save."""
    from ettr.supervisor.workers import WorkerGroup

    saving = FakeWorker(30, stops_on=())
    quick = FakeWorker(31, stops_on=())
    group = WorkerGroup([saving, quick], flush_s=0.0, teardown_grace_s=0.0)
    group.signal_tree(15)
    quick.code = 143  # done saving, exits 143 (128 + SIGTERM)
    assert group.poll() is None and saving.signals == [15]  # no second SIGTERM
    saving.code = 143
    assert group.poll() == 143


def test_a_group_where_every_worker_exits_0_completes() -> None:
    from ettr.supervisor.workers import WorkerGroup

    workers = [FakeWorker(40), FakeWorker(41)]
    group = WorkerGroup(workers)
    workers[0].code = 0
    assert group.poll() is None and workers[1].signals == []  # rank 0 done first: rank 1 is left to finish
    workers[1].code = 0
    assert group.poll() == 0 and group.failed_rank is None


def test_the_supervisor_says_once_why_it_keeps_the_real_torchrun(monkeypatch, capsys, tmp_path) -> None:
    from ettr.supervisor.attempt import CommandKind
    from ettr.supervisor.config import RunConfig
    from ettr.supervisor.supervise import kind_for
    from ettr.supervisor.worker_kind import WorkerGroupKind

    multi = kind_for(RunConfig(command=(*RUN, "--nnodes", "1", "--tee", "3", "t.py")), tmp_path)
    assert isinstance(multi, CommandKind)
    assert capsys.readouterr().err.count("runs the real torchrun (torchrun option --tee)") == 1
    monkeypatch.setenv("ETTR_AGENT", "torchrun")
    forced = kind_for(RunConfig(command=(*RUN, "--standalone", "t.py")), tmp_path)
    assert isinstance(forced, CommandKind)
    assert "ETTR_AGENT=torchrun" in capsys.readouterr().err
    monkeypatch.delenv("ETTR_AGENT")
    agent_kind = kind_for(RunConfig(command=(*RUN, "--standalone", "t.py")), tmp_path)
    assert isinstance(agent_kind, WorkerGroupKind) and isinstance(agent_kind.spec, WorkerSpec)
    assert capsys.readouterr().err == ""
    plain = kind_for(RunConfig(command=(sys.executable, "t.py")), tmp_path)
    assert isinstance(plain, CommandKind) and capsys.readouterr().err == ""


def test_a_marked_failed_exit_is_the_failure_at_once_and_its_teardown_is_cut_short(tmp_path: Path) -> None:
    from ettr.supervisor.workers import WorkerGroup

    tearing_down, other = FakeWorker(50), FakeWorker(51)
    markers = [tmp_path / "failed-pid-50", tmp_path / "failed-pid-51"]
    group = WorkerGroup([tearing_down, other], flush_s=0.0, teardown_grace_s=60.0, exit_markers=markers)
    assert group.poll() is None and group.failed_rank is None
    markers[0].touch()  # rank 0's uncaught exception: recorded, exit handlers done, interpreter teardown left
    assert group.poll() is None
    assert group.failed_rank == 0 and tearing_down.signals == [9] and other.signals == [15]
    assert group.poll() == 1  # Python's status after an uncaught exception, not the SIGKILL


def test_workers_whose_python_exit_is_done_are_exiting_not_hung(tmp_path: Path) -> None:
    from ettr.supervisor.workers import WorkerGroup

    a, b = FakeWorker(60), FakeWorker(61)
    failed = [tmp_path / "failed-pid-60", tmp_path / "failed-pid-61"]
    exited = [tmp_path / "exited-pid-60", tmp_path / "exited-pid-61"]
    group = WorkerGroup([a, b], exit_markers=failed, exited_markers=exited)
    assert not group.exiting()
    exited[0].touch()
    assert not group.exiting()  # rank 1 still trains (or hangs): the watchdog keeps watching
    b.code = 0
    assert group.exiting()  # rank 1 is done; rank 0 only tears its interpreter down
    assert group.poll() is None and a.signals == []  # a clean exit is left to finish on its own


# -- restart in place (ettr.supervisor.inplace) ---------------------------------------------------------------
class KeptWorker(FakeWorker):
    def kill_leftovers(self) -> None:
        self.signals.append(9)

    def finish(self, timeout_s: float = 2.0) -> None:
        pass


def _joined(run_dir: Path, attempt: int, *workers: FakeWorker, trained: bool = True) -> None:
    """`workers` joined `attempt` (and, with `trained`, the first of them took the attempt's first step)."""
    from ettr.run_env import inplace_ready_path, trained_path

    for w in workers:
        path = inplace_ready_path(run_dir, attempt, w.pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    if trained and workers:
        trained_path(run_dir, attempt, workers[0].pid).touch()


def test_a_dead_worker_whose_peers_joined_the_attempt_is_recovered_in_place(tmp_path: Path) -> None:
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.watch_events import Continued
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(40), KeptWorker(41), KeptWorker(42)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 0)
    _joined(tmp_path, 0, *workers)
    workers[1].code = -9
    assert group.poll() is None and group.events() == [Continued(-9, at=group.failed_at)]
    assert group.events() == []  # said once
    assert all(w.signals == [] for w in workers)  # nothing torn down
    assert group.failed_pids() == [[41]] and group.stderr_tail() == ["tail of 41"]
    replacement = KeptWorker(43)
    group.continue_as(1, {1: replacement}, tmp_path)
    assert group.pids == [40, 43, 42] and workers[1].signals == [9]  # the dead one's leftovers swept
    assert group.ranks() == {40: 0, 43: 1, 42: 2}  # the survivors recorded no PROCESS_START in attempt 1
    _joined(
        tmp_path, 1, workers[0], replacement, workers[2], trained=False
    )  # attempt 1 has not trained yet ...
    replacement.code = -9
    assert group.poll() is None and workers[0].signals == [15] and workers[2].signals == [15]
    assert group.poll() == -9  # ... so a failure now (during the in-place recovery) is a process restart


def test_a_failure_before_the_attempt_trained_is_a_process_restart_though_every_worker_joined(
    tmp_path: Path,
) -> None:
    """A worker that dies while `train` sets up (before the first step) can leave its peers in a group
    formation they do not give up for the group's whole timeout (gloo's `new_group`: 30 min), where its
    replacement would give up after the rendezvous timeout and the job fail: a process restart instead."""
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(70), KeptWorker(71)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 2)
    _joined(tmp_path, 2, *workers, trained=False)
    workers[1].code = -9
    assert group.poll() is None and group.continued is None and workers[0].signals == [15]
    assert group.poll() == -9


def test_a_failure_while_a_worker_has_not_joined_the_attempt_is_a_process_restart(tmp_path: Path) -> None:
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(80), KeptWorker(81), KeptWorker(82)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 1)
    _joined(tmp_path, 1, workers[0], workers[1])  # worker 82 has not joined attempt 1 yet ...
    workers[1].code = 1
    assert group.poll() is None and workers[0].signals == [15] and workers[2].signals == [15]
    assert group.poll() == 1  # ... so a failure now is a process restart, as without in place


def test_a_failure_the_worker_survived_goes_on_in_place_with_nothing_replaced(tmp_path: Path) -> None:
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.inplace import InPlace, InPlaceCheck
    from ettr.supervisor.watch_events import Continued
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(50), KeptWorker(51)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 3)
    _joined(tmp_path, 3, *workers)
    assert group.poll() is None and group.continued is None
    inplace_failed_path(tmp_path, 3, 51).touch()
    assert group.poll() is None
    assert group.continued == InPlace(failed_rank=1, returncode=1, dead=())
    assert group.continued.survived  # no process exited: the books give no exit status
    assert group.events() == [Continued(1, at=group.failed_at, survived=True)]


def test_a_survived_failure_is_blamed_on_the_rank_whose_own_error_it_was(tmp_path: Path) -> None:
    """Rank 1 raised; rank 0's collective then failed with "Connection closed by peer" and it said so too.
    The failure is rank 1's (before: the lowest rank that said it failed, rank 0, the victim, was booked
    as the failed rank, and the report read "exit status 1 (rank 0)")."""
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.inplace import InPlace, InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(52), KeptWorker(53), KeptWorker(54)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 2)
    _joined(tmp_path, 2, *workers)
    said = {52: False, 53: True, 54: False}  # pid -> own
    for pid, own in said.items():
        marker = {"rank": pid - 52, "error": "RuntimeError: x", "own": own}
        inplace_failed_path(tmp_path, 2, pid).write_text(json.dumps(marker))
    assert group.poll() is None
    assert group.continued == InPlace(failed_rank=1, returncode=1, dead=())
    assert group.failed_pids() == [[53]]


def test_a_dead_worker_whose_peers_never_joined_is_a_process_restart(tmp_path: Path) -> None:
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(60), KeptWorker(61)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 0)  # a script without ettr.resilient: no worker joins
    workers[0].code = 1
    assert group.poll() is None and group.continued is None and workers[1].signals == [15]
    assert group.poll() == 1


def test_the_in_place_store_is_owned_by_the_run_and_removed_with_it(tmp_path: Path) -> None:
    from ettr.run_env import INPLACE_STORE_ENV, remove_memory_dirs_of_run
    from ettr.supervisor.inplace import enabled, store_env

    environ = {"ETTR_MEMORY_DIR": str(tmp_path / "shm")}
    env = store_env(tmp_path / "run", environ)
    store = Path(env[INPLACE_STORE_ENV].removeprefix("file://"))
    assert env["ETTR_INPLACE"] == "1" and store.parent.is_dir() and store.parent.parent == tmp_path / "shm"
    assert remove_memory_dirs_of_run(tmp_path / "run", environ) == [store.parent]
    assert not store.parent.exists()
    assert enabled({}) and not enabled({"ETTR_INPLACE": "0"})


def test_a_worker_kind_that_starts_nothing_leaves_nothing_in_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-place store is made at the first start (under a supervisor, which removes it at the job's
    end), not when the kind is made: a kind only inspected leaked a directory into /dev/shm."""
    from ettr.supervisor.worker_kind import WorkerGroupKind

    monkeypatch.setenv("ETTR_MEMORY_DIR", str(tmp_path / "shm"))
    spec = WorkerSpec(nproc=2, argv=(sys.executable, "t.py"))
    WorkerGroupKind(spec, run_dir=tmp_path / "run", max_restarts=1, teardown_grace_s=1.0)
    assert not (tmp_path / "shm").exists()


def test_a_generation_that_failed_before_the_attempt_trained_is_a_process_restart_at_once(
    tmp_path: Path,
) -> None:
    """A resilient job's generation restored, took no step (its loop was done) and raised at the end: its
    ranks said the attempt failed and waited in the wrapper for the next one, which the agent never
    announces before the attempt has trained. Before, they waited out the rendezvous timeout (120 s, the
    DLRM trial's attempt 3) or the hang detector killed them as hung; now the process restart begins."""
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(90), KeptWorker(91)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 4)
    _joined(tmp_path, 4, *workers, trained=False)
    assert group.poll() is None and all(w.signals == [] for w in workers)  # no failure said: nothing
    said = {90: False, 91: True}  # pid -> own: rank 1 raised, rank 0 saw it through a collective
    for pid, own in said.items():
        marker = {"rank": pid - 90, "error": "ValueError: x", "own": own}
        inplace_failed_path(tmp_path, 4, pid).write_text(json.dumps(marker))
    assert group.poll() is None and group.continued is None
    assert workers[1].signals[:1] == [9] and workers[0].signals == [15]
    workers[0].code, workers[1].code = -15, -9
    assert group.poll() == 1  # booked as rank 1's failure, exit status 1 (its uncaught exception)
    assert group.failed_pids() == [[91]]


def test_a_worker_that_exits_0_while_its_peers_say_the_attempt_failed_is_replaced_in_place(
    tmp_path: Path,
) -> None:
    """A rank left `train` on its own (its SIGTERM handler's `sys.exit(0)`: a SystemExit passes through
    `ettr.resilient`); its peer's collective failed ("Connection closed by peer") and it said so. Seen in
    pytorch/examples' minGPT-ddp port (5 December 2026): before, the attempt read "rank 0 raised an
    exception", nothing was replaced, and rank 0 waited 120 s in the next generation's rendezvous for the
    rank that had left, then gave up."""
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.inplace import InPlace, InPlaceCheck
    from ettr.supervisor.watch_events import Continued
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(90), KeptWorker(91)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 1)
    _joined(tmp_path, 1, *workers)
    marker = {"rank": 0, "error": "RuntimeError: Connection closed by peer", "own": False}
    inplace_failed_path(tmp_path, 1, 90).write_text(json.dumps(marker))
    assert group.poll() is None and group.continued is None  # rank 1 is still on its way out: not rank 0's
    workers[1].code = 0
    assert group.poll() is None
    assert group.continued == InPlace(failed_rank=1, returncode=0, dead=(1,))
    assert group.continued.left and not group.continued.survived
    assert group.events() == [Continued(0, at=group.failed_at)]
    assert group.failed_pids() == [[91]] and workers[0].signals == []  # nothing torn down


def test_a_worker_that_exits_0_at_the_end_is_no_failure(tmp_path: Path) -> None:
    """Every rank returned from `train` (the wrapper waits for all before it returns): one exiting before the
    other is the job's end, not a rank that left."""
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [KeptWorker(92), KeptWorker(93)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 0)
    _joined(tmp_path, 0, *workers)
    workers[0].code = 0
    assert group.poll() is None and group.continued is None and workers[1].signals == []
    workers[1].code = 0
    assert group.poll() == 0


def test_a_worker_killed_by_a_signal_is_seen_gone_when_the_group_saw_it(tmp_path: Path) -> None:
    """A SIGKILLed rank records no FAILURE: the agent's own look at its exit is the failure instant (the
    report's detection read `?` for every such rank under ettr's agent). A raise the worker lived on from
    and a clean exit are no deaths."""
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.classify import classify
    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.workers import WorkerGroup

    workers = [FakeWorker(60), FakeWorker(61)]
    group = WorkerGroup(workers, flush_s=0.0, teardown_grace_s=60.0)
    assert group.seen_gone() == []
    workers[1].code = -9
    while group.poll() is None:
        pass
    assert group.seen_gone() == [(group.failed_at, [61])]
    end = classify(
        returncode=-9, failed_pids=group.failed_pids(), seen_gone=group.seen_gone(), ranks=group.ranks()
    )
    assert end.rank_gone_ts == group.failed_at

    kept = [KeptWorker(62), KeptWorker(63)]  # in place: the dead one is seen gone, a survived raise is not
    dead = WorkerGroup(kept, flush_s=0.0, teardown_grace_s=60.0)
    dead.inplace = InPlaceCheck(tmp_path, 0)
    _joined(tmp_path, 0, *kept)
    kept[0].code = -9
    assert dead.poll() is None and dead.seen_gone() == [(dead.failed_at, [62])]
    lived = [KeptWorker(64), KeptWorker(65)]
    raised = WorkerGroup(lived, flush_s=0.0, teardown_grace_s=60.0)
    raised.inplace = InPlaceCheck(tmp_path, 1)
    _joined(tmp_path, 1, *lived)
    inplace_failed_path(tmp_path, 1, 65).touch()
    assert raised.poll() is None and raised.continued is not None and raised.seen_gone() == []
    done = WorkerGroup([FakeWorker(66)])
    done.procs[0].code = 0
    assert done.poll() == 0 and done.seen_gone() == []


def test_an_in_place_attempt_counts_only_the_workers_it_started_warm(tmp_path: Path) -> None:
    """`attempt 1 continues in place: 2 worker(s), ..., 2 in warm standbys` was printed for an exception both
    workers lived on from (nothing started): the count was the first attempt's, survivors included."""
    from types import SimpleNamespace

    from ettr.supervisor.inplace import InPlaceCheck
    from ettr.supervisor.spares import Spares
    from ettr.supervisor.worker_kind import WorkerGroupKind
    from ettr.supervisor.workers import WorkerGroup

    kept = [KeptWorker(90), KeptWorker(91)]
    group = WorkerGroup(kept, warm=[True, True], flush_s=0.0, teardown_grace_s=60.0)
    group.inplace = InPlaceCheck(tmp_path, 0)
    _joined(tmp_path, 0, *kept)
    kept[1].code = -9
    assert group.poll() is None and group.continued is not None
    kind = object.__new__(WorkerGroupKind)  # the parts `continue_in_place` uses, no standbys: a cold start
    kind._workers = ([[sys.executable, "-c", "pass"]] * 2, [{}, {}])
    kind._standbys, kind._zygote, kind._port, kind._run_dir = None, None, 0, tmp_path
    kind._spares = Spares(tmp_path)
    kind._env = lambda plan, rank, port: {"PATH": os.environ.get("PATH", "")}
    kind.continue_in_place(group, SimpleNamespace(attempt=1))
    try:
        assert group.warm == [False, False]  # rank 0 went on, rank 1 started cold
        assert "warm standbys" not in group.describe() and "zygote" not in group.describe()
    finally:
        group.procs[1].finish()


def test_a_forged_inplace_failure_marker_reads_as_the_ranks_own_failure(tmp_path):
    # Anyone who writes the run directory writes the markers: 5,000 brackets raised RecursionError out of
    # the agent's in-place check (json.loads); unreadable means own.
    from ettr.run_env import inplace_failed_path
    from ettr.supervisor.inplace import InPlaceCheck

    path = inplace_failed_path(tmp_path, 0, 4321)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[" * 5000)
    assert InPlaceCheck(tmp_path, 0).said_own_failure(4321) is True
    path.write_text('{"own": false}')
    assert InPlaceCheck(tmp_path, 0).said_own_failure(4321) is False
