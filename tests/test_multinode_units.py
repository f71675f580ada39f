"""The pure parts of multi-node jobs and Slurm: node roles, the peers' view of the ledger, the budget, the
port rewrite, SIGUSR1 and the SLURM_RESTART_COUNT cross-check."""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ettr.accounting import compute
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.ledger import Ledger, MemoryLedger
from ettr.supervisor import peer_words, peers, slurm
from ettr.supervisor.config import RunConfig
from ettr.supervisor.launch import torchrun_command, torchrun_options
from ettr.supervisor.multinode import FollowerPeers, LeaderPeers, node_role_of
from ettr.supervisor.peers import NoPeers
from ettr.supervisor.supervise import supervisor_for

TORCHRUN = [
    "torchrun",
    "--nnodes=2",
    "--node-rank",
    "1",
    "--rdzv-backend=c10d",
    "--rdzv-endpoint=node0:29400",
]


def _sup(kind: EventKind, attempt: int, ts: float, **data: object) -> Event:
    return Event(kind, ts, attempt, SUPERVISOR_RANK, data=data or None)


def test_node_role_from_torchrun_options() -> None:
    role = peers.node_role(torchrun_options([*TORCHRUN, "train.py"]))
    assert role is not None and (role.node_rank, role.nnodes, role.leader, role.peers) == (1, 2, False, (0,))
    assert peers.node_role(torchrun_options(["torchrun", "--nproc-per-node=2", "train.py"])) is None
    assert peers.node_role(torchrun_options(["python", "train.py", "--nnodes=2"])) is None  # the script's
    assert peers.node_role([("--nnodes", "3:3"), ("--node_rank", "2")]) == peers.NodeRole(
        node_rank=2, nnodes=3
    )
    with pytest.raises(ValueError, match="elastic"):
        peers.node_role([("--nnodes", "1:4")])
    with pytest.raises(ValueError, match="not in 0..1"):
        peers.node_role([("--nnodes", "2"), ("--node-rank", "2")])


def test_a_multi_node_job_needs_a_shared_ledger_and_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    command = (*TORCHRUN, "train.py")
    with pytest.raises(UsageError, match="needs --ledger URL"):
        node_role_of(RunConfig(command=command, job_id="j"))
    with pytest.raises(UsageError, match="needs --job-id"):
        node_role_of(RunConfig(command=command, ledger_url="sqlite:///x.db"))
    cfg = RunConfig(command=command, ledger_url="sqlite:///x.db", job_id="j")
    follower = supervisor_for(cfg).peers
    assert isinstance(follower, FollowerPeers) and not follower.leads and follower.node_rank == 1
    leader = RunConfig(
        command=tuple(a if a != "1" else "0" for a in command), ledger_url="sqlite:///x", job_id="j"
    )
    assert isinstance(supervisor_for(leader).peers, LeaderPeers) and supervisor_for(leader).peers.leads
    assert isinstance(supervisor_for(RunConfig(command=("python", "t.py"))).peers, NoPeers)


def test_the_agreed_port_replaces_a_remote_endpoint() -> None:
    out = torchrun_command([*TORCHRUN, "train.py"], 31234, any_host=True)
    assert "--rdzv-endpoint=node0:31234" in out and out[-1] == "train.py"
    assert "--rdzv-endpoint=node0:29400" in torchrun_command([*TORCHRUN, "train.py"], 31234)


def test_peer_view_reads_ports_ends_beats_and_the_job_end() -> None:
    events = [
        peers.node_mark(peers.NODE_START, node_rank=1, attempt=0, ts=1.0),
        peers.node_mark(peers.RENDEZVOUS, node_rank=0, attempt=0, ts=2.0, port=100),
        peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=3.0, supervisor_pid=7),
        peers.node_mark(peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=4.0, outcome="failed", reason="x"),
        _sup(EventKind.ATTEMPT_END, 0, 5.0, outcome="failed"),
        peers.node_mark(peers.RENDEZVOUS, node_rank=0, attempt=1, ts=6.0, port=200),
        peers.node_mark(peers.NODE_HEARTBEAT, node_rank=0, attempt=1, ts=7.0),
    ]
    view = peers.peer_view(events)
    assert dict(view.ports) == {0: 100, 1: 200}
    assert set(view.ended) == {0} and view.node_joined[(0, 1)] == 7
    assert peers.failed_peer(view, 0, [1]) == (
        1,
        {"name": "node_attempt_end", "node_rank": 1, "outcome": "failed", "reason": "x"},
    )
    assert peers.failed_peer(view, 1, [1]) is None
    assert peers.open_attempt(view, after=-1) == 1 and peers.open_attempt(view, after=1) is None
    assert view.last_beat == {0: 7.0, 1: 4.0}
    # Node 1 beat during the attempt (since=3) and went silent; node 0 is fresh.
    assert peers.lost_peers(view, [0, 1], since=3.0, now=10.0, timeout_s=4.0) == [1]
    # Silent since before the attempt began: not lost in it (its rendezvous waits for it).
    assert peers.lost_peers(view, [1], since=5.0, now=100.0, timeout_s=4.0) == []
    assert view.job_end_at is None
    ended = peers.peer_view([*events, _sup(EventKind.JOB_END, 1, 8.0, exit_status=0)])
    assert (ended.job_end_at, ended.job_end_status) == (len(events), 0)


def test_a_restarted_node_supervisor_is_found_live_until_its_end() -> None:
    start = peers.node_mark(peers.NODE_START, node_rank=1, attempt=0, ts=1.0, pid=5, host="h")
    assert peers.live_node_supervisor([start], 1) == start.data
    assert peers.live_node_supervisor([start], 2) is None
    end = peers.node_mark(peers.NODE_END, node_rank=1, attempt=0, ts=2.0)
    assert peers.live_node_supervisor([start, end], 1) is None


def test_node_marks_do_not_change_the_report() -> None:
    base = [
        _sup(EventKind.SUPERVISOR_START, 0, 0.0),
        _sup(EventKind.ATTEMPT_START, 0, 1.0),
        Event(EventKind.STEP, 2.0, 0, 0, step=1),
        Event(EventKind.STEP, 3.0, 0, 1, step=1),
        _sup(EventKind.ATTEMPT_END, 0, 4.0, outcome="completed", exit_code=0),
        _sup(EventKind.JOB_END, 0, 5.0, exit_status=0),
    ]
    marks = [
        peers.node_mark(peers.NODE_HEARTBEAT, node_rank=n, attempt=0, ts=t)
        for n in (0, 1)
        for t in (0.5, 3.5)
    ]
    assert compute(base, now=9.0).buckets_s == compute(base + marks, now=9.0).buckets_s


def test_slurm_warning_becomes_sigterm_and_restart_count_is_cross_checked() -> None:
    assert slurm.forwarded_signal(signal.SIGUSR1) == signal.SIGTERM
    assert slurm.forwarded_signal(signal.SIGINT) == signal.SIGINT
    runs = [_sup(EventKind.SUPERVISOR_START, 0, 0.0), _sup(EventKind.ATTEMPT_START, 0, 1.0)]
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    assert slurm.restart_count_note(runs, env) is None
    note = slurm.restart_count_note([], env)
    assert note is not None and "restarted 1 time(s)" in note and "0 earlier run(s)" in note
    assert "\n" not in note
    assert slurm.restart_count_note([], {"SLURM_RESTART_COUNT": "1"}) is None  # not inside Slurm
    assert "not a number" in (slurm.restart_count_note([], {**env, "SLURM_RESTART_COUNT": "x"}) or "")
    assert "outside a Slurm job" in slurm.requeue({}).line and not slurm.requeue({}).queued
    assert slurm.in_step({"SLURM_JOB_ID": "42", "SLURM_STEP_NUM_TASKS": "2"})
    assert not slurm.in_step({"SLURM_JOB_ID": "42"})  # the batch script: `B:USR1` reaches it alone


def test_a_job_slurm_requeued_is_not_told_to_be_continued_by_hand() -> None:
    # Field trial (Lightning's bug_report_model, `--signal=USR1@T` through srun): Lightning's own handler ran
    # `scontrol requeue`, Slurm's SIGTERM stopped the job, and `ettr run` said "to continue it (a requeue):
    # ettr run ...": a second copy beside the run Slurm starts anyway.
    shown = "JobId=42 JobName=x JobState=PENDING Reason=BeginTime Restarts=1 BatchFlag=1"
    env = {"SLURM_JOB_ID": "42"}
    line = slurm.queued_again(env, show=lambda job: shown)
    assert line == "Slurm requeued job 42 (Restarts=1, JobState=PENDING): it runs again from the queue"
    assert (
        slurm.queued_again({**env, "SLURM_RESTART_COUNT": "1"}, show=lambda job: shown) is None
    )  # as it began
    assert slurm.queued_again({**env, "SLURM_RESTART_COUNT": "0"}, show=lambda job: shown) is not None
    assert slurm.queued_again(env, show=lambda job: "") is None  # scontrol could not say: the hint stays
    assert slurm.queued_again({}, show=lambda job: shown) is None  # not inside Slurm
    assert slurm.queued_again(env, show=lambda job: "Restarts=x") is None


def test_a_requeue_slurm_did_already_is_not_said_to_have_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Field trial: the node went down as Slurm's USR1 warning came; Slurm requeued the job itself, and the
    # supervisor's own `scontrol requeue` was refused: "scontrol requeue 3 failed: Job is pending execution".
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\necho "scontrol: error: Job is pending execution for job $2" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    line, queued = slurm.requeue({"SLURM_JOB_ID": "3"})
    assert queued and "failed" not in line and "pending again already" in line and "job 3" in line
    # Lightning's SIGUSR1 handler runs `scontrol requeue` itself: not necessarily Slurm's doing
    assert "requeued by Slurm:" not in line and "by the job's own handler" in line
    fake.write_text(
        '#!/bin/sh\necho "scontrol: error: Requested operation is presently disabled" >&2\nexit 1\n'
    )
    line, queued = slurm.requeue({"SLURM_JOB_ID": "3"})
    assert not queued and line.startswith("scontrol requeue 3 failed: scontrol: error: Req")


def test_the_peers_read_only_the_supervisors_events(tmp_path: Path) -> None:
    from ettr.ledger.sqlite import SqliteLedger
    from ettr.supervisor.books import JobBooks

    ledger = SqliteLedger(tmp_path / "ledger.db")
    events = [
        _sup(EventKind.ATTEMPT_START, 0, 1.0),
        Event(EventKind.STEP, 2.0, 0, 0, step=1),
        peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=3.0),
    ]
    ledger.append(events)
    config = RunConfig(command=("python", "t.py"))

    def books(ledger: Ledger) -> JobBooks:
        return JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger)

    assert books(ledger).supervisor_events() == [events[0], events[2]]
    no_narrow_query = MemoryLedger(events)
    assert books(no_narrow_query).supervisor_events() == [events[0], events[2]]
    ledger.close()


def test_bad_multi_node_command_lines_are_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from ettr.cli import main

    bad = [
        (["run", "--job-id", "x", "--", *TORCHRUN, "t.py"], "needs --ledger URL"),
        (
            ["run", "--job-id", "x", "--ledger", "sqlite:///x.db", "--", "torchrun", "--nnodes=1:3", "t.py"],
            "elastic",
        ),
    ]
    for argv, what in bad:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and "\n" not in err and err.startswith("ettr run: ")


def test_node_0_opening_after_a_follower_says_nothing_of_continuing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two agents started together: node 1 wrote its node marks first, and node 0 said "continuing job m1
    # (attempt 0)" of a job that had just begun. A requeue (an earlier SUPERVISOR_START) still says so.
    from ettr.supervisor.books import JobBooks

    config = RunConfig(command=("python", "t.py"))
    ledger = MemoryLedger([peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=3.0)])
    assert JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger).open() == 0
    assert "continuing job" not in capsys.readouterr().err
    ledger = MemoryLedger([_sup(EventKind.SUPERVISOR_START, 0, 1.0), _sup(EventKind.ATTEMPT_START, 0, 2.0)])
    JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger).open()
    assert "continuing job j" in capsys.readouterr().err


def test_node_0_books_a_collective_failure_caused_by_a_peer_as_that_peers(tmp_path: Path) -> None:
    """Node 1 died (its whole process group): node 0's ranks failed first on the broken connection, and the
    attempt read `collective`. Node 0 now looks at its peers before booking such a failure: a peer that went
    silent is node_lost, a peer that failed gives its own cause; a peer heard since is no cause."""
    import time

    from ettr.causes import Detail, diagnose
    from ettr.events import Outcome
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd
    from ettr.supervisor.signals import SupervisorSignals

    command = (*TORCHRUN[:3], "0", *TORCHRUN[4:], "train.py")
    config = RunConfig(command=command, ledger_url="sqlite:///x.db", job_id="j", peer_timeout_s=4.0)
    mine = AttemptEnd(  # as torchrun's failure summary ends it: the gloo reset is in the message only
        outcome=Outcome.FAILED, exit_code=1, reason="exit status 1 (rank 0): RuntimeError",
        exception="RuntimeError", message="[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer",
        stderr_tail=("  error_file: <N/A>", "=" * 60),
    )  # fmt: skip

    def settle(*marks: Event) -> AttemptEnd:
        leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
        joined = peers.node_mark(
            peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=now - 10, supervisor_pid=7
        )
        ledger = MemoryLedger([joined, *marks])
        leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
        end = leader.settle(0, mine, None, SupervisorSignals())
        return end

    reset = {"exception": "DistBackendError", "message": "Connection reset by peer"}

    def detail(end: AttemptEnd, process: dict | None = None) -> Detail:  # as the report diagnoses it, with
        failure = {**end.to_data(), "process_failure": process or reset}  # the first FAILURE a rank recorded
        return diagnose(outcome=end.outcome, failure=failure, trained=True).detail

    now = time.time()
    silent = peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=now - 6)
    assert detail(mine) is Detail.COLLECTIVE  # what it read before
    assert detail(settle(silent)) is Detail.NODE_LOST
    crashed = peers.node_mark(
        peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=now - 1, outcome="failed", exit_code=1,
        reason="exit status 1", exception="InjectedCrash", stderr_tail=["InjectedCrash: at step 6"],
    )  # fmt: skip
    end = settle(silent, crashed)
    crash = {"exception": "InjectedCrash", "message": "at step 6"}  # rank 1's FAILURE came first
    assert (detail(end, crash), end.exception) == (Detail.EXCEPTION, "InjectedCrash")
    killed = peers.node_mark(
        peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=now - 1, outcome="failed", exit_code=137,
        signal="SIGKILL", reason="killed by SIGKILL (rank 1)",
    )  # fmt: skip
    assert detail(settle(killed)) is Detail.PROCESS_LOST
    alive = peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=now + 3600)  # heard since
    assert settle(alive) == mine


class _CountingSignals:
    """SupervisorSignals as the peers use it: no signal; each wait is recorded, not slept."""

    first = None

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)


def test_waits_between_attempts_look_every_second_not_every_heartbeat_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Field trial (default --peer-timeout 60: heartbeats every 10 s): node 1 joined each attempt 10 s after
    node 0 had published its rendezvous, and node 0 booked 10 s more shutdown waiting for node 1's end of a
    completed attempt. Both waits now look at the ledger every second."""
    from ettr.events import Outcome
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd

    def books(ledger: Ledger, config: RunConfig) -> JobBooks:
        return JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger)

    follower_cfg = RunConfig(command=(*TORCHRUN, "t.py"), ledger_url="sqlite:///x.db", job_id="j")
    assert follower_cfg.peer_timeout_s == 60.0
    follower = FollowerPeers(follower_cfg, peers.NodeRole(node_rank=1, nnodes=2))
    follower.node.attach(books(MemoryLedger([]), follower_cfg))
    turn = follower.turn(-1, 100.0)
    assert turn.attempt is None and turn.status is None and 0 < turn.wait_s <= 1.0
    # (a node that took part in an attempt waits for "node 0's next attempt or the job's end")
    assert "node 1: waiting for node 0 to open an attempt" in capsys.readouterr().err

    leader_cfg = replace(follower_cfg, command=(*TORCHRUN[:3], "0", *TORCHRUN[4:], "t.py"))
    leader = LeaderPeers(leader_cfg, peers.NodeRole(node_rank=0, nnodes=2))
    ledger = MemoryLedger([])
    leader.node.attach(books(ledger, leader_cfg))
    signals = _CountingSignals()

    def peer_ends(timeout_s: float) -> None:  # node 1 ends its part while node 0 waits
        signals.waits.append(timeout_s)
        ledger.append(
            [peers.node_mark(peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=1.0, outcome="completed")]
        )

    signals.wait = peer_ends  # type: ignore[method-assign]
    done = AttemptEnd(outcome=Outcome.COMPLETED, exit_code=0, reason="completed")
    assert leader.settle(0, done, None, signals) == done  # type: ignore[arg-type]
    assert signals.waits and all(0 < w <= 1.0 for w in signals.waits)


def test_the_requeue_line_of_a_ledger_job_names_its_job_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Field trial: node 0 of a two-node job got SIGTERM and printed `to continue it (a requeue): ettr run
    --run-dir ... --ledger URL -- torchrun ...`; that command was refused (`a multi-node job needs --job-id`),
    and on one node it would have opened a new job under a made-up id. Node 1 printed no such line."""
    import shlex

    from ettr.constants import EXIT_PREEMPTED
    from ettr.supervisor.supervise import Supervisor

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    url = f"sqlite:///{tmp_path / 'l.db'}"
    leader = (*TORCHRUN[:3], "0", *TORCHRUN[4:], "t.py")
    for command in (leader, (*TORCHRUN, "t.py"), ("python", "t.py")):
        config = RunConfig(command=command, ledger_url=url, job_id="llm-042", run_dir=str(tmp_path / "n"))
        supervisor_for(config)._say_end(EXIT_PREEMPTED)
        line = next(x for x in capsys.readouterr().err.splitlines() if "to continue it" in x)
        argv = shlex.split(line.split("(a requeue): ", 1)[1])
        assert argv[argv.index("--job-id") + 1] == "llm-042" and argv[argv.index("--ledger") + 1] == url
        assert tuple(argv[argv.index("--") + 1 :]) == command
    Supervisor(RunConfig(command=("python", "t.py"), run_dir=str(tmp_path / "r")))._say_end(EXIT_PREEMPTED)
    assert "--job-id" not in capsys.readouterr().err  # the run directory holds its id


def test_a_node_given_another_nnodes_than_a_live_peer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Field trial: node 0 with --nnodes 2, node 1 with --nnodes 3. Both waited in torchrun's rendezvous,
    saying "still no training step after 120 s (cold start ...)", until torchrun's join timeout (600 s).
    The node that comes second is refused (one line, status 2) before it writes anything, either way round;
    a peer that is gone (silent, or ended) does not count."""
    import time

    from ettr.cli import main
    from ettr.ledger.url import open_url

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    url = f"sqlite:///{tmp_path / 'l.db'}"

    def node_start(rank: int, nnodes: int, ts: float) -> Event:
        return peers.node_mark(
            peers.NODE_START, node_rank=rank, attempt=0, ts=ts, pid=4242, host="node0", nnodes=nnodes
        )

    def written() -> list[Event]:
        ledger = open_url(url, job_id="j")
        try:
            return ledger.read()
        finally:
            ledger.close()

    def run(rank: int, nnodes: int) -> tuple[int, str]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                    f"--node-rank={rank}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "t.py"]  # fmt: skip
        argv = ["run", "--run-dir", str(tmp_path / f"n{rank}"), "--ledger", url, "--job-id", "j"]
        status = main([*argv, "--", *torchrun])
        return status, capsys.readouterr().err.strip()

    role = peers.NodeRole(node_rank=0, nnodes=2)
    gone = [node_start(1, 3, 100.0)]
    assert peers.another_size(gone, role, now=100.0 + 61, timeout_s=60) is None  # silent: not a peer now
    assert "node 1 of this job runs with --nnodes 3" in (
        peers.another_size(gone, role, now=159, timeout_s=60) or ""
    )
    assert peers.another_size([node_start(1, 2, 100.0)], role, now=100.0, timeout_s=60) is None

    ledger = open_url(url, job_id="j", create=True)
    ledger.append([node_start(0, 2, time.time())])
    ledger.close()
    before = written()
    status, err = run(1, 3)
    assert status == 2 and "\n" not in err, err
    assert err == (
        "ettr run: node 0 of this job runs with --nnodes 2 (supervisor pid 4242 on node0), this node with "
        "--nnodes 3: give every node the same --nnodes"
    )
    assert written() == before  # nothing written

    ledger = open_url(url, job_id="j")  # node 0 came second, node 1 (--nnodes 3) waiting
    ledger.append([peers.node_mark(peers.NODE_END, node_rank=0, attempt=0, ts=time.time())])
    ledger.append([node_start(1, 3, time.time())])
    ledger.close()
    before = written()
    status, err = run(0, 2)
    assert status == 2 and "node 1 of this job runs with --nnodes 3" in err and "\n" not in err
    assert written() == before


def test_a_nodes_part_is_classified_by_its_own_ranks_only() -> None:
    """Field trial: node 1's torchrun SIGKILLed. Its rank recorded nothing; node 0's rank recorded gloo's
    "Connection closed by peer", and node 1's part (and so the attempt) was booked `killed by SIGKILL:
    RuntimeError` with node 0's message: the consequence named as the cause, on the wrong node."""
    from ettr.supervisor.classify import classify, this_nodes_events

    def start(rank: int, pid: int, host: str, supervisor: int) -> Event:
        data = {"pid": pid, "host": host, "world_size": 2, "local_rank": 0, "supervisor_pid": supervisor}
        return Event(EventKind.PROCESS_START, 1.0, 0, rank, data=data)

    gone = {
        "exception": "RuntimeError",
        "message": "[pair.cc:553] Connection closed by peer [127.0.0.1]:30385",
    }
    events = [
        start(0, 500, "vm", 11),  # node 0's supervisor is pid 11, node 1's pid 12, one host (two supervisors)
        start(1, 501, "vm", 12),
        Event(EventKind.STEP, 2.0, 0, 1, step=5),
        Event(EventKind.FAILURE, 3.0, 0, 0, data=gone),
    ]
    assert classify(returncode=-9, events=events).exception == "RuntimeError"  # as booked before
    mine = this_nodes_events(events, host="vm", supervisor_pid=12)
    assert mine == [events[1], events[2]]
    end = classify(returncode=-9, events=mine)
    assert (end.exception, end.reason) == (None, "killed by SIGKILL")
    assert this_nodes_events(events, host="vm", supervisor_pid=11) == [events[0], events[3]]
    assert this_nodes_events(events, host="node1", supervisor_pid=12) == []  # same pids on another host
    unnamed = Event(EventKind.PROCESS_START, 1.0, 0, 3, data={"pid": 9})  # before 2026-12-04: kept
    assert this_nodes_events([unnamed], host="vm", supervisor_pid=12) == [unnamed]
    follower = FollowerPeers(
        RunConfig(command=(*TORCHRUN, "t.py"), ledger_url="sqlite:///x.db", job_id="j"),
        peers.NodeRole(node_rank=1, nnodes=2),
    )
    assert follower.own_events(events) == this_nodes_events(
        events, host=socket.gethostname(), supervisor_pid=os.getpid()
    )
    assert NoPeers().own_events(events) == events  # one supervisor's ranks, whatever their hosts


def test_node_0s_start_up_lines_name_the_nodes_its_rendezvous_waits_for() -> None:
    """Field trial: node 1 never started. Node 0 said `still no training step after 30 s (cold start:
    interpreter, imports, model build, restore)` until torchrun's rendezvous timed out; it now says whom the
    rendezvous waits for."""
    from ettr.supervisor.startwait import StartupWait

    published = [peers.node_mark(peers.RENDEZVOUS, node_rank=0, attempt=0, ts=1.0, port=100)]
    view = peers.peer_view(published)
    assert peers.absent(view, 0, [1], now=31.0) == (
        "torchrun's rendezvous waits for node(s) 1 to join: node 1's supervisor never started"
    )
    heard = peers.peer_view(
        [*published, peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=9.0)]
    )
    assert peers.absent(heard, 0, [1], now=31.0) == (
        "torchrun's rendezvous waits for node(s) 1 to join: node 1's supervisor last heard 22 s ago"
    )
    joined = peers.peer_view(
        [
            *published,
            peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=2.0, supervisor_pid=7),
        ]
    )
    assert peers.absent(joined, 0, [1], now=31.0) is None
    assert peers.absent(joined, 0, [0], now=31.0) is None  # node 0 (a follower's peer) published its port
    assert "node(s) 0 to join" in (peers.absent(joined, 1, [0], now=31.0) or "")  # not attempt 1's yet
    assert NoPeers().absent(0) is None

    wait = StartupWait(0, 0.0, path="cold", absent=lambda a: peers.absent(view, a, [1], now=31.0))
    assert (
        wait.check(1.0, trained=False)
        == "attempt 0: waiting for its first training step (cold start: interpreter, imports, model build, restore)"
    )
    assert wait.check(31.0, trained=False) == (
        "attempt 0: still no training step after 31 s (torchrun's rendezvous waits for node(s) 1 to join: "
        "node 1's supervisor never started)"
    )
    alone = StartupWait(0, 0.0, path="cold", absent=lambda a: None)
    alone.check(1.0, trained=False)
    assert alone.check(31.0, trained=False) == (
        "attempt 0: still no training step after 31 s (cold start: interpreter, imports, model build, restore)"
    )


def test_a_peer_killed_without_an_exception_does_not_lend_node_0s_broken_connection(tmp_path: Path) -> None:
    """Field trial (PostgreSQL ledger): node 1's torchrun SIGKILLed; node 1 booked its part `killed by
    SIGKILL` (no exception), and node 0's ATTEMPT_END said so but carried node 0's own rank's gloo
    "Connection closed by peer" as the attempt's exception: the consequence beside the cause."""
    from ettr.events import Outcome
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd

    command = (*TORCHRUN[:3], "0", *TORCHRUN[4:], "train.py")
    config = RunConfig(command=command, ledger_url="sqlite:///x.db", job_id="j", peer_timeout_s=4.0)
    leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
    killed = peers.node_mark(
        peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=1.0, outcome="failed", exit_code=137,
        signal="SIGKILL", reason="killed by SIGKILL", exception=None, message=None,
    )  # fmt: skip
    joined = peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=0.5, supervisor_pid=7)
    ledger = MemoryLedger([joined, killed])
    leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
    broken = AttemptEnd(
        outcome=Outcome.FAILED, exit_code=1, reason="exit status 1 (rank 0): RuntimeError",
        exception="RuntimeError", message="[pair.cc:553] Connection closed by peer [127.0.0.1]:30385",
    )  # fmt: skip
    end = leader.settle(0, broken, None, _CountingSignals())  # type: ignore[arg-type]
    assert (end.reason, end.signal, end.exit_code) == (
        "node 1's part ended failed: killed by SIGKILL",
        "SIGKILL",
        137,
    )
    assert (end.exception, end.message) == (None, None)
    own = replace(
        broken, exception="ValueError", message="bad batch", reason="exit status 1 (rank 0): ValueError"
    )
    leader.node.peer_end = dict(killed.data or {})
    end = leader.node.peer_ended(own, "node 1's part ended failed: killed by SIGKILL")
    assert (end.exception, end.message) == ("ValueError", "bad batch")  # its own error, not a consequence


def _leader_after_rendezvous(tmp_path: Path) -> tuple[LeaderPeers, MemoryLedger]:
    """Node 0 of a two-node job whose books hold attempt 0's rendezvous, and those books."""
    from ettr.supervisor.books import JobBooks

    config = RunConfig(
        command=(*TORCHRUN[:3], "0", *TORCHRUN[4:], "t.py"), ledger_url="sqlite:///x", job_id="j"
    )
    leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
    ledger = MemoryLedger([peers.node_mark(peers.RENDEZVOUS, node_rank=0, attempt=0, ts=1.0, port=100)])
    leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
    return leader, ledger


def test_the_absent_nodes_are_read_fresh_for_each_start_up_line(tmp_path: Path) -> None:
    # The cached view (one look per heartbeat interval) said "node 1's supervisor last heard 10 s ago" of
    # a node that had joined the attempt since.

    leader, ledger = _leader_after_rendezvous(tmp_path)
    assert leader.node.look(2.0, force=True) is not None
    assert "node 1's supervisor never started" in (leader.absent(0) or "")
    ledger.append(
        [peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=3.0, supervisor_pid=7)]
    )
    assert leader.absent(0) is None


def test_a_nodes_part_names_its_failed_rank_though_it_holds_one_rank_of_the_world() -> None:
    # Classified by its own ranks, node 1's part (one rank of two) read `exit status 1: InjectedCrash`: the
    # rank is named only where the ranks seen are several, and this node saw one.
    from ettr.supervisor.classify import classify, this_nodes_events

    data = {"pid": 501, "host": "vm", "world_size": 2, "local_rank": 0, "supervisor_pid": 12}
    events = [
        Event(EventKind.PROCESS_START, 1.0, 0, 0, data={**data, "pid": 500, "supervisor_pid": 11}),
        Event(EventKind.PROCESS_START, 1.0, 0, 1, data=data),
        Event(EventKind.FAILURE, 3.0, 0, 1, data={"exception": "InjectedCrash", "message": "at step 50"}),
    ]
    mine = this_nodes_events(events, host="vm", supervisor_pid=12)
    assert (
        classify(returncode=1, events=mine, failed_pids=[[501]]).reason
        == "exit status 1 (rank 1): InjectedCrash"
    )
    crash = Event(EventKind.FAILURE, 3.0, 0, 0, data={"exception": "InjectedCrash", "message": "at step 50"})
    alone = [Event(EventKind.PROCESS_START, 1.0, 0, 0, data={**data, "world_size": 1}), crash]
    assert classify(returncode=1, events=alone, failed_pids=[[501]]).reason == "exit status 1: InjectedCrash"


def test_an_attempt_whose_rendezvous_timed_out_names_the_nodes_that_never_joined(tmp_path: Path) -> None:
    # Node 1 never started: node 0's attempt ended `exit status 1` (torchrun's RendezvousTimeoutError).
    from ettr.events import Outcome
    from ettr.supervisor.classify import AttemptEnd

    leader, ledger = _leader_after_rendezvous(tmp_path)
    timed_out = AttemptEnd(outcome=Outcome.FAILED, exit_code=1, reason="exit status 1")
    end = leader.settle(0, timed_out, None, _CountingSignals())  # type: ignore[arg-type]
    assert end.reason == (
        "exit status 1 (torchrun's rendezvous waits for node(s) 1 to join: node 1's supervisor never started)"
    )
    ledger.append([Event(EventKind.PROCESS_START, 2.0, 0, 0, data={"pid": 5})])  # its ranks ran: not that
    assert leader.settle(0, timed_out, None, _CountingSignals()) == timed_out  # type: ignore[arg-type]


def test_node_0s_hang_reason_names_what_each_nodes_ranks_were_doing(tmp_path: Path) -> None:
    """Field trial (the DDP tutorial's multinode.py, two nodes, rank 1 on node 1 SIGSTOPped): node 0 found
    the hang first and booked `rank 0 (pid P) quiet 20.0 s, ..., asleep (waiting: a collective ...)`, the
    victim's side only; node 1's own end said `rank 1 ... stopped (SIGSTOP or SIGTSTP)`, 2 s later, in a mark
    no report shows. Node 0 now waits for the peers' ends and adds each node's ranks to the reason."""
    import time

    from ettr.events import Outcome
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd, classify

    mine = classify(
        returncode=1,
        hung_after_s=20.0,
        hung_ranks="rank 0 (pid 11) quiet 20.0 s, asleep (waiting: a collective)",
    )
    assert mine.outcome is Outcome.HUNG and mine.to_data()["hung_ranks"].startswith("rank 0 (pid 11)")
    assert AttemptEnd.from_data(mine.to_data()).hung_ranks == mine.hung_ranks
    theirs = classify(
        returncode=137, hung_after_s=20.1, hung_ranks="rank 1 (pid 12) quiet 20.7 s, stopped (SIGSTOP)"
    )

    command = (*TORCHRUN[:3], "0", *TORCHRUN[4:], "train.py")
    config = RunConfig(command=command, ledger_url="sqlite:///x.db", job_id="j", peer_timeout_s=4.0)
    now = time.time()

    def settle(*marks: Event, end_while_waiting: bool = False) -> AttemptEnd:
        leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
        ledger = MemoryLedger(list(marks))
        leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
        signals = _CountingSignals()

        def node_1_ends(timeout_s: float) -> None:  # node 1 finds the same silence and ends its part
            signals.waits.append(timeout_s)
            ledger.append([peers.node_mark(peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=time.time(),
                                           **theirs.to_data())])  # fmt: skip

        if end_while_waiting:
            signals.wait = node_1_ends  # type: ignore[method-assign]
        return leader.settle(0, mine, None, signals)  # type: ignore[arg-type]

    joined = peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=now, supervisor_pid=7)
    end = settle(joined, end_while_waiting=True)
    assert end.outcome is Outcome.HUNG
    assert end.reason.startswith(mine.reason)
    assert end.reason.endswith("; node 1: rank 1 (pid 12) quiet 20.7 s, stopped (SIGSTOP)")
    assert end.hung_ranks == f"{mine.hung_ranks}; node 1: rank 1 (pid 12) quiet 20.7 s, stopped (SIGSTOP)"
    # a peer whose part ended without describing its ranks (its torchrun lost the store first): unknown
    failed = peers.node_mark(
        peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=now, outcome="failed", exit_code=1, reason="x"
    )
    assert settle(joined, failed).reason.endswith("; node 1: its ranks unknown (its part ended failed)")
    # a peer that never joined the attempt adds nothing, and is not waited for
    assert settle().reason == mine.reason


def test_the_text_report_says_a_hangs_ranks_once() -> None:
    """`hung_ranks` ends the hang's reason: the text report printed it a second time, node 0's alone, as
    `hung_ranks=rank 0 ... asleep` under the reason that named every node's ranks."""
    from ettr.report.text import _failure_lines

    failure = {
        "reason": "no progress ...; rank 0 asleep; node 1: rank 1 stopped",
        "hung_ranks": "rank 0 asleep",
    }
    lines = _failure_lines(0, "hung", failure)
    assert lines == ["  attempt 0 hung: no progress ...; rank 0 asleep; node 1: rank 1 stopped"]


def test_a_peer_preempted_makes_the_attempt_preempted_not_a_counted_failure(tmp_path: Path) -> None:
    """Field trial: node 1's supervisor got SIGTERM (its node preempted) and booked its part `preempted`;
    node 0 booked the attempt `failed` and spent one of the job's restarts on it ("restarting in 0 s (1 of
    3)"), where a preemption of the job's processes is restarted uncounted."""
    import time

    from ettr.events import Outcome
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd
    from ettr.supervisor.policy import EndedAttempt, RestartPolicy

    command = (*TORCHRUN[:3], "0", *TORCHRUN[4:], "train.py")
    config = RunConfig(command=command, ledger_url="sqlite:///x.db", job_id="j", peer_timeout_s=4.0)
    leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
    now = time.time()
    joined = peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=now, supervisor_pid=7)
    preempted = peers.node_mark(
        peers.NODE_ATTEMPT_END, node_rank=1, attempt=0, ts=now, outcome="preempted", exit_code=143,
        signal="SIGTERM", reason="SIGTERM forwarded to the job; SIGTERM to torchrun, which stopped its workers",
    )  # fmt: skip
    ledger = MemoryLedger([joined, preempted])
    leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
    reason = leader.check(0, now, now - 5)
    assert reason is not None and reason.startswith("node 1's part ended preempted")
    stopped = AttemptEnd(outcome=Outcome.FAILED, exit_code=1, reason="SIGTERM to torchrun", signal="SIGTERM")
    end = leader.settle(0, stopped, reason, _CountingSignals())  # type: ignore[arg-type]
    assert end.outcome is Outcome.PREEMPTED
    decision = RestartPolicy(max_restarts=1).decide(EndedAttempt(attempt=0, end=end, made_progress=True))
    assert decision.restart and "not counted" in decision.why
    for theirs, ours in (("hung", Outcome.HUNG), ("failed", Outcome.FAILED), ("forged", Outcome.FAILED)):
        leader.node.peer_end = {"outcome": theirs}
        assert leader.node.peer_ended(stopped, "x").outcome is ours


def test_a_forged_port_or_job_status_in_the_ledger_is_not_used() -> None:
    """The ledger every node writes is read by every node: a rendezvous `port` of `true` (an int to
    isinstance) was launched as `--rdzv-endpoint HOST:True`, and a JOB_END `exit_status` of 256 made the
    followers exit 0 (`sys.exit` keeps the low byte), a failed job reported completed to their scheduler."""
    marks = [peers.node_mark(peers.RENDEZVOUS, node_rank=0, attempt=a, ts=1.0, port=p)
             for a, p in enumerate((True, 0, 70000, -1, "29400", 29400))]  # fmt: skip
    view = peers.peer_view(marks)
    assert view.ports == {5: 29400}
    for status, seen in ((256, None), (True, None), (-1, None), (2**40, None), (143, 143), (0, 0)):
        view = peers.peer_view([_sup(EventKind.JOB_END, 0, 2.0, exit_status=status)])
        assert view.job_end_at == 0 and view.job_end_status == seen


def test_a_survivors_exception_after_a_node_loss_is_said_to_be_its_consequence() -> None:
    """Field trial (two nodes, node 0's supervisor SIGKILLed): the attempt, closed from the ledger, read
    `RuntimeError: ... Connection reset by peer` under its reason, node 1's rank's broken connection shown as
    the attempt's exception with nothing saying it came after the loss."""
    from ettr.report.text import _failure_lines

    failure = {
        "reason": "its supervisor was lost (killed) while it ran; closed from the ledger",
        "closed_from_ledger": True,
        "process_failure": {"exception": "RuntimeError", "message": "Connection reset by peer", "rank": 1},
    }
    lines = _failure_lines(0, "failed", failure, after_loss=True)
    assert lines[1] == (
        "    RuntimeError: Connection reset by peer (rank 1, after the loss: its consequence, not the cause)"
    )
    assert _failure_lines(0, "failed", failure)[1] == "    RuntimeError: Connection reset by peer (rank 1)"


def test_a_node_that_cannot_see_the_checkpoint_another_node_restored_says_so(tmp_path: Path) -> None:
    """Field trial (the DDP tutorial's multinode.py, `snapshot.pt` relative to each node's own directory):
    after a restart rank 0 resumed from its snapshot, rank 1 on node 1 found none and started from epoch 0;
    rank 0 finished first and rank 1's next collective broke. Every attempt read `exit status 1 (rank 1):
    RuntimeError: Connection closed by peer` until exit 3, nothing naming the missing checkpoint."""
    from ettr.events import Outcome, Phase
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd

    here = tmp_path / "wd0" / "snapshot.pt"
    there = "/nonexistent-ettr-node0/wd0/snapshot.pt"

    def start(rank: int, pid: int) -> Event:
        return Event(
            EventKind.PROCESS_START, 1.0, 1, rank, data={"host": socket.gethostname(), "supervisor_pid": pid}
        )

    def restore(rank: int, path: str) -> Event:
        return Event(
            EventKind.PHASE_END, 2.0, 1, rank, phase=Phase.RESTORE, step=160, value=1.0, data={"path": path}
        )

    events = [start(0, 100), start(1, os.getpid()), restore(0, there)]
    assert peer_words.unseen_restore(events, [events[1]], os.path.exists, 1) == (
        f"node 1 cannot see {there!r}, the checkpoint rank 0 restored (step 160), and no rank of this node "
        "restored one: is the checkpoint directory on a file system every node shares?"
    )
    assert peer_words.unseen_restore(events, events[1:2] + [restore(1, there)], os.path.exists, 1) is None
    here.parent.mkdir()
    here.write_bytes(b"x")
    seen = [start(0, 100), start(1, os.getpid()), restore(0, str(here))]
    assert (
        peer_words.unseen_restore(seen, seen[1:2], os.path.exists, 1) is None
    )  # shared: rank 1 chose not to
    relative = [start(0, 100), start(1, os.getpid()), restore(0, "snapshot.pt")]
    assert peer_words.unseen_restore(relative, relative[1:2], os.path.exists, 1) is None

    config = RunConfig(command=(*TORCHRUN, "t.py"), ledger_url="sqlite:///x.db", job_id="j")
    follower = FollowerPeers(config, peers.NodeRole(node_rank=1, nnodes=2))
    follower.node.attach(
        JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=MemoryLedger(events))
    )
    broken = AttemptEnd(outcome=Outcome.FAILED, exit_code=1, reason="exit status 1 (rank 1): RuntimeError")
    end = follower.settle(1, broken, None, _CountingSignals())  # type: ignore[arg-type]
    assert end.reason.startswith("exit status 1 (rank 1): RuntimeError; node 1 cannot see ")
    done = AttemptEnd(outcome=Outcome.COMPLETED, exit_code=0, reason="completed")
    assert follower.settle(1, done, None, _CountingSignals(), events) == done  # type: ignore[arg-type]


def test_a_job_slurm_queued_again_gets_no_hint_to_continue_it_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm trial: after `--signal=B:USR1@50` the supervisor said `asked Slurm to requeue job 4`, then `to
    continue it (a requeue): ettr run ...`: Slurm runs the job again itself; the hint is for a requeue that
    did not happen."""
    from ettr.constants import EXIT_PREEMPTED
    from ettr.supervisor.supervise import Supervisor

    fake = tmp_path / "scontrol"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("SLURM_JOB_ID", "4")
    for script, queued in (("exit 0", True), ('echo "scontrol: error: Access denied" >&2; exit 1', False)):
        fake.write_text(f"#!/bin/sh\n{script}\n")
        fake.chmod(0o755)
        supervisor = Supervisor(RunConfig(command=("python", "t.py"), run_dir=str(tmp_path / "r")))
        supervisor.signals.first = slurm.WARNING_SIGNAL
        supervisor._say_end(EXIT_PREEMPTED)
        err = capsys.readouterr().err
        assert ("asked Slurm to requeue job 4" in err) is queued
        assert ("to continue it (a requeue)" in err) is not queued


def test_a_failed_part_waiting_for_a_silent_peer_says_what_it_waits_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Field trial (two `ettr run` nodes on one machine, pytorch/examples' DDP tutorial, default
    --peer-timeout 60): node 1's supervisor and rank SIGKILLed; node 0's rank failed at once on the broken
    connection, and node 0 then waited for node 1 to end its part or be found lost (60 s with no
    replacement; 5.4 s here, until the replacement node marked the old attempt ended) without a word: the
    console showed nothing after `a rank failed; stopping the others`. It now says what it waits for."""
    from types import SimpleNamespace

    from ettr.events import Outcome
    from ettr.supervisor import multinode
    from ettr.supervisor.books import JobBooks
    from ettr.supervisor.classify import AttemptEnd

    t0 = 1_000_000.0
    clock = [t0]
    monkeypatch.setattr(multinode, "time", SimpleNamespace(time=lambda: clock[0]))
    config = RunConfig(
        command=(*TORCHRUN[:3], "0", *TORCHRUN[4:], "t.py"), ledger_url="sqlite:///x", job_id="j"
    )
    assert config.peer_timeout_s == 60.0
    leader = LeaderPeers(config, peers.NodeRole(node_rank=0, nnodes=2))
    joined = peers.node_mark(peers.NODE_ATTEMPT_START, node_rank=1, attempt=0, ts=t0 - 10, supervisor_pid=7)
    beat = peers.node_mark(peers.NODE_HEARTBEAT, node_rank=1, attempt=0, ts=t0 - 0.5)  # then killed
    ledger = MemoryLedger([joined, beat])
    leader.node.attach(JobBooks(config, run_dir=tmp_path, job_id="j", family="t", ledger=ledger))
    signals = _CountingSignals()
    signals.wait = lambda s: clock.__setitem__(0, clock[0] + s)  # type: ignore[method-assign]
    broken = AttemptEnd(
        outcome=Outcome.FAILED, exit_code=1, reason="exit status 1 (rank 0): RuntimeError",
        exception="RuntimeError", message="[pair.cc:553] Connection closed by peer [127.0.0.1]:30385",
    )  # fmt: skip
    end = leader.settle(0, broken, None, signals)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert (
        "attempt 0: this node's ranks failed on a broken connection; waiting for node 1 (supervisor last "
        "heard 2 s ago) to end its part, or to be found lost after 60 s of silence (--peer-timeout)"
    ) in err
    assert err.count("waiting for node 1") < 10  # repeated every 10 s of the wait, not every look
    assert "node 1's supervisor is silent for over 60 s (lost)" in end.reason
