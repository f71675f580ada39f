"""A torchrun that the job starts itself -- from a shell script, a Makefile, a Python program -- is a
launcher, never a rank: its workers are the ranks, with their own rank numbers, and `--inject` fires in them.

The fast tests use a stand-in `torchrun` (a Python script of that name that starts two workers with
torchrun's TORCHELASTIC_RUN_ID and RANK); the slow one runs the real torchrun under `ettr run -- bash`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ettr.bootstrap import pythonpath_dir
from ettr.bootstrap.start import hand_ranks_to_workers
from ettr.events import EventKind
from ettr.ledger import open_ledger, read_run_events
from ettr.run_env import launcher_parent_path, runs_torchrun, torchrun_nodes

ROOT = Path(__file__).resolve().parent.parent

# A stand-in torchrun: starts two workers as torchrun does (TORCHELASTIC_RUN_ID, RANK), waits for them.
FAKE_TORCHRUN = f"""#!{sys.executable}
import os, subprocess, sys
out = sys.argv[1]
code = (
    "import json, os, sys; "
    "import ettr.runtime as rt; "
    "mine = os.environ.get('ETTR_INSTRUMENTED_PID') == str(os.getpid()); "
    "rank = rt.get_recorder().rank if mine else None; "
    "open(sys.argv[1], 'w').write(json.dumps({{'pid': os.getpid(), 'instrumented': mine, 'rank': rank}}))"
)
workers = [
    subprocess.Popen(
        [sys.executable, "-c", code, os.path.join(out, f"worker-{{r}}.json")],
        env={{**os.environ, "TORCHELASTIC_RUN_ID": "none", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}},
    )
    for r in range(2)
]
with open(os.path.join(out, "launcher.json"), "w") as f:
    f.write('{{"pid": %d, "instrumented": %s}}' % (os.getpid(), "true" if "ettr.runtime" in sys.modules else "false"))
sys.exit(max(w.wait() for w in workers))
"""


def _clean_env() -> dict[str, str]:
    """This test process's environment for an `ettr run` of a real torchrun, less what a rank or the test run set."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], True),
        (["python3", "-m", "torch.distributed.run", "--standalone", "train.py"], True),
        (["python", "-u", "-mtorch.distributed.launch", "train.py"], True),
        (["python", "train.py", "torchrun"], False),
        (["python", "torchrun_notes.py"], False),
        (["python", "-c", "import torch.distributed.run"], False),
        (["python"], False),
    ],
)
def test_a_torchrun_launcher_is_told_by_its_command_line(argv: list[str], expected: bool) -> None:
    assert runs_torchrun(argv) is expected


@pytest.mark.parametrize(
    ("argv", "nodes"),
    [
        (["python", "torchrun", "--nnodes", "2", "--node-rank", "1", "train.py"], 2),
        (["python", "-m", "torch.distributed.run", "--nnodes=1:4", "train.py"], 4),
        (["python", "torchrun", "--nproc-per-node", "2", "train.py"], None),
        (["python", "torchrun", "--nnodes", "$NNODES", "train.py"], None),
        (["python", "torchrun", "--nnodes"], None),
    ],
)
def test_the_nodes_a_torchrun_asks_for(argv: list[str], nodes: int | None) -> None:
    assert torchrun_nodes(argv) == nodes


def test_a_multi_node_torchrun_started_by_a_node_script_says_its_books_are_this_nodes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ettr run -- bash node.sh R`, node.sh running `torchrun --nnodes 2 ...` on each node: each supervisor
    sees one node; the torchrun says so. A node's supervisor running torchrun itself (docs/multinode.md) and a
    one-node torchrun say nothing."""
    import ettr.bootstrap.start as start_module

    torchrun = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "--node-rank", "1", "train.py"]
    cases = [
        ({"ETTR_LAUNCHER": "other"}, torchrun, True),
        ({"ETTR_LAUNCHER": "torchrun"}, torchrun, False),
        ({"ETTR_LAUNCHER": "other"}, [*torchrun[:2], "--standalone", "train.py"], False),
    ]
    for extra, argv, warned in cases:
        monkeypatch.setattr(start_module, "_started", {})  # this process's own bootstrap state is left alone
        caplog.clear()
        environ = {"ETTR_RUN_DIR": str(tmp_path), "ETTR_ATTEMPT": "0", **extra}
        with caplog.at_level("WARNING", logger="ettr"):
            start_module.start(environ, argv=argv)
        said = [r.getMessage() for r in caplog.records if "runs 2 nodes" in r.getMessage()]
        assert bool(said) is warned, (extra, argv, said)
        assert environ["ETTR_LAUNCHER"] == "torchrun"  # its workers are the ranks either way


def test_the_launcher_hands_the_ranks_to_its_workers_and_tells_the_program_above_it(tmp_path: Path) -> None:
    environ = {
        "ETTR_RUN_DIR": str(tmp_path),
        "ETTR_ATTEMPT": "2",
        "ETTR_LAUNCHER": "python",
        "ETTR_INSTRUMENTED_PID": "41",  # the Python program that started this torchrun
    }
    hand_ranks_to_workers(environ, 42)
    assert environ["ETTR_LAUNCHER"] == "torchrun" and "ETTR_INSTRUMENTED_PID" not in environ
    assert launcher_parent_path(tmp_path, 2, 41).read_text() == "42"
    alone = {"ETTR_RUN_DIR": str(tmp_path), "ETTR_ATTEMPT": "2", "ETTR_LAUNCHER": "other"}
    hand_ranks_to_workers(alone, 43)  # started by a shell: nobody above it to tell
    assert alone["ETTR_LAUNCHER"] == "torchrun"
    assert sorted(p.name for p in launcher_parent_path(tmp_path, 2, 0).parent.iterdir()) == [
        "launcher-parent-pid-41"
    ]


def test_a_program_that_turned_out_to_be_a_launcher_fires_no_fault_and_stops_beating(tmp_path: Path) -> None:
    from ettr.heartbeat import MainThreadHeartbeat
    from ettr.inject import FaultActions, Injector, parse_spec

    launched = tmp_path / "launcher-parent-pid-1"
    fired: list[str] = []

    class Actions(FaultActions):
        def crash(self) -> None:
            fired.append("crash")

    class Rec:
        attempt, rank = 0, 0

        def add_step_listener(self, listener: object) -> None:
            self.listener = listener

        def record(self, *args: object, **kwargs: object) -> None:
            pass

        def flush(self, timeout_s: float = 5.0) -> None:
            pass

    rec = Rec()
    spec = [parse_spec("crash@step=2"), parse_spec("crash@step=3")]
    Injector(spec, rec, actions=Actions(), stands_down=launched.exists).start()  # type: ignore[arg-type]
    rec.listener(2)
    launched.touch()  # its torchrun started: the workers are the ranks
    rec.listener(3)
    assert fired == ["crash"]

    path = tmp_path / "beat"
    launched.unlink()
    beat = MainThreadHeartbeat(path, stands_down=launched.exists)
    path.touch()
    assert beat.sample() is True  # news: the first look
    launched.touch()
    beat._last = None  # the stack moved again
    assert beat.sample() is False and beat._stop.is_set()  # no beat, and the sampler ends

    # A wrapper waiting for its torchrun in subprocess.run pulsed `other` (a wait site) before the torchrun
    # said it launched: its pulse would have held every rank's bound at the phase bound. Asked at every
    # sample, it stands down with its stack still, and its pulse goes.
    from ettr.heartbeat import Progress

    launched.unlink()
    progress = Progress()
    progress.add_wait_site(sys._getframe().f_code, "other")  # this test's frame is the wait
    beat = MainThreadHeartbeat(path, stands_down=launched.exists, progress=progress)
    assert beat.sample() is True and beat.pulse()
    pulse = path.with_name(path.name + ".pulse")
    assert '"phases":["other"]' in pulse.read_text()
    launched.touch()
    assert beat.sample() is False and beat._stop.is_set() and not pulse.exists()


def _job_env(run_dir: Path, bin_dir: Path, launcher: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(
        PYTHONPATH=f"{pythonpath_dir()}{os.pathsep}{ROOT / 'src'}",
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        ETTR_RUN_DIR=str(run_dir),
        ETTR_ATTEMPT="0",
        ETTR_AUTO="0",
        ETTR_LAUNCHER=launcher,
    )
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("parent", ["bash", "make", "python"])
def test_the_workers_of_a_torchrun_started_inside_the_job_are_the_ranks(tmp_path: Path, parent: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(FAKE_TORCHRUN)
    torchrun.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    if parent == "bash":
        command = ["bash", "-c", f"cd {tmp_path} && torchrun {out}"]
    elif parent == "make":
        (tmp_path / "Makefile").write_text(f"train:\n\ttorchrun {out}\n")
        command = ["make", "-s", "-C", str(tmp_path), "train"]
    else:  # a Python program, itself the attempt's first (instrumented) Python process
        launch = tmp_path / "launch.py"
        launch.write_text(
            textwrap.dedent(
                f"""
                import json, os, subprocess, sys
                with open({str(out / "program.json")!r}, "w") as f:
                    json.dump({{"pid": os.getpid(), "instrumented": os.environ.get("ETTR_INSTRUMENTED_PID") == str(os.getpid())}}, f)
                subprocess.run(["torchrun", {str(out)!r}], check=True)
                """
            )
        )
        command = [sys.executable, str(launch)]
    if parent == "make" and subprocess.run(["which", "make"], capture_output=True).returncode != 0:
        pytest.skip("no make on this machine")
    done = subprocess.run(
        command, env=_job_env(run_dir, bin_dir, "python" if parent == "python" else "other"), timeout=120
    )
    assert done.returncode == 0
    launcher = json.loads((out / "launcher.json").read_text())
    workers = [json.loads((out / f"worker-{r}.json").read_text()) for r in range(2)]
    assert not launcher["instrumented"]  # never a rank (not even ettr's recorder imported)
    assert [(w["instrumented"], w["rank"]) for w in workers] == [(True, 0), (True, 1)]
    starts = {
        (e.rank, e.data["pid"]) for e in open_ledger(run_dir).read() if e.kind is EventKind.PROCESS_START
    }
    worker_starts = {(r, w["pid"]) for r, w in enumerate(workers)}
    if parent == "python":
        program = json.loads((out / "program.json").read_text())
        assert program["instrumented"]  # the first Python process: instrumented before it started torchrun
        assert starts == worker_starts | {(0, program["pid"])}
        # ... and then told that it is a launcher: it fires no fault and stops beating
        assert launcher_parent_path(run_dir, 0, program["pid"]).read_text() == str(launcher["pid"])
    else:
        assert starts == worker_starts


def test_a_single_python_process_behind_a_shell_is_still_the_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    (tmp_path / "train.py").write_text(
        "import json, os, sys\n"
        "import ettr.runtime as rt\n"
        f"json.dump({{'mine': os.environ.get('ETTR_INSTRUMENTED_PID') == str(os.getpid()), "
        f"'rank': rt.get_recorder().rank}}, open({str(out)!r}, 'w'))\n"
    )
    run_dir = tmp_path / "run"
    command = ["bash", "-c", f"cd {tmp_path} && {sys.executable} train.py"]
    done = subprocess.run(command, env=_job_env(run_dir, tmp_path, "other"), timeout=120)
    assert done.returncode == 0
    assert json.loads(out.read_text()) == {"mine": True, "rank": 0}
    starts = [e for e in open_ledger(run_dir).read() if e.kind is EventKind.PROCESS_START]
    assert [e.rank for e in starts] == [0]


DDP = ROOT / "tests" / "scripts" / "train_ddp.py"


@pytest.mark.slow
def test_a_bash_wrapper_around_torchrun_is_recorded_rank_by_rank_and_faults_fire_in_the_workers(
    tmp_path: Path,
) -> None:
    wrapper = tmp_path / "run_ddp.sh"
    ckpt = tmp_path / "ckpt"
    wrapper.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            set -e
            RESUME=""
            if ls {ckpt}/step-*.pt >/dev/null 2>&1; then RESUME=yes; fi
            echo "resume: ${{RESUME:-no}}"
            {sys.executable} -m torch.distributed.run --nproc-per-node 2 {DDP} --ckpt-dir {ckpt} \\
                --num-steps 10 --save-every 4 --step-s 0.05
            """
        )
    )
    run_dir = tmp_path / "run"
    env = _clean_env()
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--inject", "crash@step=6,rank=1",
         "--", "bash", str(wrapper)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "never fired" not in done.stderr
    events = read_run_events(run_dir)
    ranks = {(e.attempt, e.rank) for e in events if e.kind is EventKind.PROCESS_START}
    assert ranks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # the workers, torchrun's launcher never
    fired = [e for e in events if e.kind is EventKind.MARK and (e.data or {}).get("name") == "inject"]
    assert [(e.attempt, e.rank) for e in fired] == [(0, 1)]
    ends = [e.data["outcome"] for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends == ["failed", "completed"]
    last_step = {(a, r): max(e.step for e in events if e.kind is EventKind.STEP and (e.attempt, e.rank) == (a, r))
                 for a, r in ranks}  # fmt: skip
    assert last_step[(0, 1)] == 6 and last_step[(1, 0)] == last_step[(1, 1)] == 10
    resumed = {e.step for e in events if e.kind is EventKind.RESUMED and e.attempt == 1}
    assert resumed == {4}


@pytest.mark.parametrize(
    ("argv", "restarts"),
    [
        (
            [
                "/venv/bin/python",
                "/venv/bin/torchrun",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                "t.py",
            ],
            2,
        ),
        (
            ["torchrun", "--max_restarts=3", "t.py", "--max-restarts", "9"],
            3,
        ),  # the script's own flag is not it
        (["python", "-m", "torch.distributed.run", "--max-restarts", "1", "t.py"], 1),
        (["torchrun", "--max-restarts", "2", "--max-restarts=0", "t.py"], 0),  # the last one given: ettr's
        (["torchrun", "--max-restarts", "x", "t.py"], 0),
        (["python", "train.py", "--max-restarts", "4"], 0),
        (["bash", "run.sh"], 0),
        ([], 0),
    ],
)
def test_the_restarts_a_torchrun_makes_of_its_own(argv: list[str], restarts: int) -> None:
    from ettr.supervisor.launch import own_restarts

    assert own_restarts(argv) == restarts


@pytest.mark.slow
def test_a_torchrun_exec_ed_with_restarts_of_its_own_is_stopped_with_its_workers(tmp_path: Path) -> None:
    # `exec torchrun --max-restarts 2 ...` behind a wrapper (the wrapper's pid is torchrun's): after a rank
    # failed, ettr SIGTERMed the other workers and left torchrun alone, which started its workers again
    # instead of ending; the new ones ran until the grace's SIGKILL (restart 10.8 s where a wrapper without
    # `exec` took 2.7 s: pytorch/examples-style DDP + DCP script, 2026-12-05).
    wrapper = tmp_path / "run_ddp.sh"
    wrapper.write_text(
        f"#!/bin/bash\nexec {sys.executable} -m torch.distributed.run --nproc-per-node 2 --max-restarts 2 {DDP} "
        f"--ckpt-dir {tmp_path / 'ckpt'} --num-steps 10 --save-every 4 --step-s 0.05\n"
    )
    run_dir = tmp_path / "run"
    env = _clean_env()
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--grace", "120",
         "--inject", "crash@step=6,rank=1", "--", "bash", str(wrapper)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = read_run_events(run_dir)
    (first, _) = [e.data for e in events if e.kind is EventKind.ATTEMPT_END]
    assert first["outcome"] == "failed"
    # torchrun itself was asked to end (its workers stopped, it exited), not SIGKILLed with a new generation
    assert "SIGTERM to torchrun, which stopped its workers" in first["reason"], first["reason"]
    assert "outlived" not in done.stderr


def test_a_signal_the_launchers_own_handler_takes_is_noted_as_the_launchers(tmp_path: Path) -> None:
    # `exec torchrun` (or `accelerate launch`) behind a wrapper, SIGTERMed from outside: torch elastic's handler
    # raises SignalException, stops the workers and exits, seconds later (2.5 s for accelerate's example on a
    # loaded machine). Without a note of when the signal came, all of that was booked as lost progress.
    code = textwrap.dedent(
        """
        import os, signal, sys
        from ettr.bootstrap import start as start_module
        start_module.start(argv=[sys.executable, "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"])
        class Stop(Exception):
            pass
        def agents(s, f):
            raise Stop(s)
        signal.signal(signal.SIGTERM, agents)
        assert signal.getsignal(signal.SIGTERM) is agents
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            import time; time.sleep(10)
        except Stop:
            print("stopped", flush=True)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "ETTR_RUN_DIR": str(tmp_path),
        "ETTR_ATTEMPT": "1",
        "ETTR_LAUNCHER": "other",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "stopped" in done.stdout, done.stderr
    from ettr.run_env import LAUNCHER_SIGNAL_RANK, signals_received

    assert [(rank, name) for _, rank, name in signals_received(tmp_path, 1)] == [
        (LAUNCHER_SIGNAL_RANK, "SIGTERM")
    ]
