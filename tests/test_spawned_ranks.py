"""Ranks a script starts itself with `torch.multiprocessing.spawn` (PyTorch's DDP tutorial, many public
scripts) are the training ranks under `ettr run`; the script's own process is their launcher
(`ettr.bootstrap.spawned`)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ettr.bootstrap.spawned import (
    MULTIPROCESSING_CHILD_ARGS,
    SpawnedRank,
    become_rank,
    hands_over,
    inherited_rank,
    joining_as,
    started_by_multiprocessing,
)
from ettr.events import EventKind
from ettr.ledger import read_run_events
from ettr.run_env import launcher_parent_path, trained_path

ROOT = Path(__file__).resolve().parents[1]


def _ettr_run(
    tmp_path: Path, *command: str, options: tuple[str, ...] = (), pythonpath: tuple[str, ...] = ()
) -> tuple[Any, list[Any]]:
    """`ettr run [options] -- command` in `tmp_path` (standbys off, no inherited rank; `pythonpath` after
    ettr's source); asserts exit 0; returns the finished process and the run's events."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *pythonpath]),
        "ETTR_STANDBY": "0",
        "HF_HOME": str(tmp_path / "hf"),
    }
    for name in ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "NODE_RANK"):
        env.pop(name, None)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), *options, "--", *command],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done, read_run_events(run_dir)


def _fired(events: list[Any]) -> list[tuple[int, int]]:
    """(attempt, rank) of every injected fault that fired."""
    return [
        (e.attempt, e.rank)
        for e in events
        if e.kind is EventKind.MARK and (e.data or {}).get("name") == "inject"
    ]


def _starts(events: list[Any]) -> list[tuple[int, int]]:
    """(attempt, rank) of every recorded process start, sorted."""
    return sorted((e.attempt, e.rank) for e in events if e.kind is EventKind.PROCESS_START)


def _last_steps(
    events: list[Any], ranks: range | tuple[int, ...] = (0, 1), attempt: int = 1
) -> dict[int, int]:
    """The last step each of `ranks` recorded in `attempt`."""
    return {
        r: max(e.step for e in events if e.kind is EventKind.STEP and (e.attempt, e.rank) == (attempt, r))
        for r in ranks
    }


def test_what_an_untrained_process_spawns_are_ranks_and_the_first_to_step_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ettr.bootstrap.start import tell_launcher
    from ettr.run_env import RunEnv

    env: dict[str, str] = {}
    assert hands_over("spawn", str(tmp_path), 0, env) and hands_over("forkserver", str(tmp_path), 0, env)
    assert not launcher_parent_path(tmp_path, 0, os.getpid()).exists()  # not until a rank steps
    for name, value in RunEnv(run_dir=tmp_path, job_id="j", attempt=0).to_environ().items():
        monkeypatch.setenv(name, value)
    tell_launcher(12345, b"spawn")  # what a spawned rank does at its first step, for its spawner
    tell_launcher(12345, b"spawn")  # the other ranks: told already
    assert launcher_parent_path(tmp_path, 0, 12345).read_bytes() == b"spawn"


@pytest.mark.parametrize(
    ("start_method", "env", "trained", "why"),
    [
        ("fork", {}, False, "a forked child is a copy of the instrumented process"),
        ("spawn", {"WORLD_SIZE": "2"}, False, "a rank's own helpers"),
        ("spawn", {"ETTR_WORLD_SIZE": "2"}, False, "a spawned rank's own helpers"),
        ("spawn", {}, True, "it trained itself: what it spawns later are helpers"),
    ],
)
def test_what_a_rank_or_a_trained_process_spawns_is_left_alone(
    tmp_path: Path, start_method: str, env: dict[str, str], trained: bool, why: str
) -> None:
    if trained:
        path = trained_path(tmp_path, 0, os.getpid())
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    assert not hands_over(start_method, str(tmp_path), 0, env), why
    assert not launcher_parent_path(tmp_path, 0, os.getpid()).exists()


def test_a_spawned_process_is_numbered_by_its_index_in_ettrs_names_only() -> None:
    from ettr.run_env import RankEnv

    env = {"ETTR_INSTRUMENTED_PID": "1"}  # the spawner's marker, inherited (no run: nothing starts)
    become_rank(1, 4, env)
    assert env == {"ETTR_RANK": "1", "ETTR_WORLD_SIZE": "4"}
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # a script's own (a torchrun of one process)
    become_rank(1, 4, env)
    assert env == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "ETTR_RANK": "1",
        "ETTR_WORLD_SIZE": "4",
    }
    assert RankEnv.from_environ(env) == RankEnv(rank=1, world_size=4, local_rank=0)  # its LOCAL_RANK
    assert RankEnv.from_environ({"ETTR_RANK": "1", "ETTR_WORLD_SIZE": "4"}) == RankEnv(
        rank=1, world_size=4, local_rank=1
    )


def _double(i: int, x: int) -> int:
    return i + 2 * x


def test_the_wrapped_function_is_picklable_and_runs_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapped = pickle.loads(pickle.dumps(SpawnedRank(_double, 2)))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ETTR_RANK", "ETTR_WORLD_SIZE", "ETTR_INSTRUMENTED_PID"):
        monkeypatch.delenv(name, raising=False)  # put back after: the wrapper sets ettr's for process 1
    assert wrapped(1, 5) == 11
    assert (os.environ["ETTR_RANK"], os.environ["ETTR_WORLD_SIZE"]) == ("1", "2")
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the script's own are left alone


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(rank, world_size, port, steps):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main, args=(2, int(sys.argv[1]), 12), nprocs=2)
    """
)


@pytest.mark.slow
def test_ranks_started_with_mp_spawn_are_recorded_and_faults_fire_in_them(tmp_path: Path) -> None:
    from ettr.supervisor.launch import free_port

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done, events = _ettr_run(
        tmp_path, sys.executable, str(script), str(free_port()), options=("--inject", "crash@step=5,rank=1")
    )
    assert "outlived its command" not in done.stderr  # multiprocessing's resource tracker leaves by itself
    steps: dict[tuple[int, int], int] = {}
    for e in events:
        if e.kind is EventKind.STEP and e.step is not None:
            steps[(e.attempt, e.rank)] = max(steps.get((e.attempt, e.rank), 0), e.step)
    assert steps[(0, 1)] == 5 and steps[(1, 0)] == steps[(1, 1)] == 12  # both spawned ranks, every attempt
    assert _fired(events) == [(0, 1)]
    failures = [(e.attempt, e.rank) for e in events if e.kind is EventKind.FAILURE]
    assert (0, 1) in failures  # recorded in the rank, although torch's own wrapper caught the exception
    ends = [e.data["outcome"] for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends == ["failed", "completed"]
    report = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "report", "--json", str(tmp_path / "run")],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["ett_pct"] is not None  # known: the spawned ranks' steps are counted


@pytest.mark.parametrize("framework", ["lightning", "huggingface"])
def test_a_framework_callback_pickles_without_its_process_recorder(framework: str) -> None:
    import threading

    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    module = __import__(f"ettr.integrations.{framework}", fromlist=["EttrCallback"])

    class Recorder:  # a process's recorder holds threads, locks and a ledger connection
        def __init__(self) -> None:
            self.lock = threading.Lock()

    callback = module.EttrCallback(recorder=Recorder())  # type: ignore[arg-type]
    copy = pickle.loads(pickle.dumps(callback))  # a Trainer sent to a spawned process (`ddp_spawn`)
    assert copy._recorder is None and callback._recorder is not None


LIGHTNING_SPAWN = textwrap.dedent(
    """
    import torch, lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 1)
        def training_step(self, b, i):
            return torch.nn.functional.mse_loss(self.l(b[0]), b[1])
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if __name__ == "__main__":
        ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        t = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(M(), DataLoader(ds, batch_size=16))
    """
)


@pytest.mark.slow
def test_lightning_ddp_spawn_runs_under_ettr_run_and_its_ranks_are_recorded(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING_SPAWN)
    # The auto-installed callback goes along with the pickled Trainer: it once held the recorder (a lock)
    _, events = _ettr_run(tmp_path, sys.executable, str(script), options=("--max-restarts", "0"))
    last = {
        r: max(e.step for e in events if e.kind is EventKind.STEP and e.rank == r and e.step) for r in (0, 1)
    }
    assert last == {0: 8, 1: 8}  # 256 samples / 16 a batch / 2 ranks


def test_a_rank_started_with_only_its_local_rank_takes_the_global_rank_its_launcher_gave() -> None:
    from ettr.run_env import RankEnv

    assert RankEnv.from_environ({"ETTR_RANK_BASE": "4", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}).rank == 5
    assert (
        RankEnv.from_environ({"ETTR_RANK_BASE": "4", "LOCAL_RANK": "1", "RANK": "2"}).rank == 2
    )  # RANK wins
    assert RankEnv.from_environ({"LOCAL_RANK": "1"}).rank == 0  # as before: no base, no RANK


@pytest.mark.slow
def test_lightning_ddp_run_as_python_records_the_ranks_it_starts_as_scripts(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING_SPAWN.replace('strategy="ddp_spawn"', 'strategy="ddp"'))
    _, events = _ettr_run(tmp_path, sys.executable, str(script), options=("--inject", "crash@step=3,rank=1"))
    assert _fired(events) == [(0, 1)]  # the rank Lightning started as a script
    assert _starts(events) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _last_steps(events) == {0: 8, 1: 8}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "/venv/bin/accelerate", "launch", "--cpu", "train.py"], True),
        (["python", "/venv/bin/accelerate-launch", "train.py"], True),
        (["python", "-m", "accelerate.commands.launch", "train.py"], True),
        (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "train.py"], True),
        (["python", "/venv/bin/accelerate", "config"], False),
        (["python", "train.py", "accelerate", "launch"], False),
        (["python"], False),
    ],
)
def test_accelerate_launch_is_told_by_its_command_line(argv: list[str], expected: bool) -> None:
    from ettr.run_env import runs_accelerate_launch

    assert runs_accelerate_launch(argv) is expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "/venv/bin/deepspeed", "--num_gpus", "2", "train.py"], True),
        (["python", "/venv/bin/ds", "train.py"], True),
        (["python", "-m", "deepspeed.launcher.runner", "train.py"], True),
        (["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "train.py"], True),
        (
            ["python", "-u", "-m", "deepspeed.launcher.launcher_helper", "--launcher", "mpich", "train.py"],
            True,
        ),
        (["python", "train.py", "--deepspeed", "ds_config.json"], False),
        (["python", "-m", "deepspeed.env_report"], False),
        (["python", "/venv/bin/ds_report"], False),
    ],
)
def test_deepspeeds_launchers_are_told_by_their_command_line(argv: list[str], expected: bool) -> None:
    from ettr.run_env import runs_deepspeed_launcher, runs_rank_launcher

    assert runs_deepspeed_launcher(argv) is expected and runs_rank_launcher(argv) is expected


ACCELERATE_SCRIPT = textwrap.dedent(
    """
    import torch
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    model, opt = torch.nn.Linear(8, 1), None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randn(128, 1)), batch_size=8)
    model, opt, data = acc.prepare(model, opt, data)
    for x, y in data:
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_script_accelerate_launch_runs_is_the_rank(tmp_path: Path, processes: int) -> None:
    pytest.importorskip("accelerate")
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.exists():
        pytest.skip("no accelerate console script beside this Python")
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT)
    # one process: the script as accelerate's child (CPU); two: torch elastic's workers in accelerate itself
    how = ["--cpu"] if processes == 1 else ["--multi_gpu", "--main_process_port", str(_free_port())]
    _, events = _ettr_run(
        tmp_path, str(accelerate), "launch", *how, "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(script),
        options=("--inject", f"crash@step=3,rank={processes - 1}"),
    )  # fmt: skip
    assert _fired(events) == [(0, processes - 1)]
    assert _starts(events) == sorted((a, r) for a in (0, 1) for r in range(processes))  # never accelerate
    assert set(_last_steps(events, range(processes)).values()) == {16 // processes}


def _free_port() -> int:
    from ettr.supervisor.launch import free_port

    return free_port()


@pytest.mark.slow
def test_the_ranks_deepspeeds_launcher_starts_are_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deepspeed_launcher: Path
) -> None:
    # `deepspeed` (its runner) starts `python -u -m deepspeed.launcher.launch`, which starts the ranks with
    # RANK, LOCAL_RANK and WORLD_SIZE set and `--local_rank=N` (ddp_steps.py takes its rank from RANK).
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    port = str(_free_port())
    _, events = _ettr_run(
        tmp_path, sys.executable, str(deepspeed_launcher), "--num_gpus", "2", "--master_port", port,
        str(DDP_STEPS), options=("--inject", "crash@step=3,rank=1"), pythonpath=(str(deepspeed_launcher.parents[1]),),
    )  # fmt: skip
    assert _fired(events) == [(0, 1)]
    # the ranks only: never the runner or its launch
    assert _starts(events) == [(0, 0), (0, 1), (1, 0), (1, 1)], _.stderr
    assert _last_steps(events) == {0: 8, 1: 8}


@pytest.mark.slow
def test_the_processes_mpirun_starts_are_the_ranks_it_numbers(tmp_path: Path, mpirun: str) -> None:
    # `mpirun -np 2 python train.py`: no RANK; each process has Open MPI's OMPI_COMM_WORLD_RANK. Before, both
    # were recorded as rank 0 (one heartbeat file, a fault for rank 1 never fired).
    root = ["--allow-run-as-root"] if os.getuid() == 0 else []
    where = ["-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}"]
    _, events = _ettr_run(
        tmp_path, mpirun, *root, "--oversubscribe", *where, "-np", "2", sys.executable, str(DDP_STEPS),
        options=("--inject", "crash@step=3,rank=1"),
    )  # fmt: skip
    assert _fired(events) == [(0, 1)]
    assert _starts(events) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _last_steps(events) == {0: 8, 1: 8}


AGENT_PROGRAM = textwrap.dedent(
    """
    import sys
    import torch.distributed.run as run
    run.main(["--nproc-per-node", "2", "--standalone", sys.argv[1]])
    """
)
DDP_STEPS = ROOT / "tests" / "scripts" / "ddp_steps.py"


@pytest.mark.slow
def test_the_workers_of_torchruns_agent_run_inside_a_program_are_the_ranks(tmp_path: Path) -> None:
    (tmp_path / "launch.py").write_text(AGENT_PROGRAM)
    _, events = _ettr_run(
        tmp_path, sys.executable, "launch.py", str(DDP_STEPS), options=("--inject", "crash@step=3,rank=1")
    )
    assert _fired(events) == [(0, 1)]
    assert _last_steps(events) == {0: 8, 1: 8}
    # The program, instrumented as rank 0 before it became the launcher, raised ChildFailedError once its
    # agent had stopped rank 0: its FAILURE says it is the launcher's (no failure instant where a rank's is).
    failures = [(e.rank, e.data) for e in events if e.kind is EventKind.FAILURE and e.attempt == 0]
    assert ("InjectedCrash", None) in [
        ((d or {}).get("exception"), (d or {}).get("launcher")) for _, d in failures
    ]
    assert [d.get("launcher") for _, d in failures if (d or {}).get("exception") == "ChildFailedError"] == [
        True
    ]


ELASTIC_FUNCTION_PROGRAM = textwrap.dedent(
    """
    import runpy, sys
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    def train(path):  # a function entrypoint: elastic puts RANK & co. in the worker only when it runs
        runpy.run_path(path, run_name="__main__")

    if __name__ == "__main__":
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="t", rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
        )
        elastic_launch(config, train)(sys.argv[1])
    """
)


@pytest.mark.slow
def test_the_workers_of_an_elastic_launch_of_a_function_are_the_ranks(tmp_path: Path) -> None:
    # Hugging Face's `notebook_launcher`, a framework's own launcher: `elastic_launch(config, train)(...)`
    # spawns workers whose rank elastic's `_wrap` sets only after the interpreter started: nothing was
    # recorded (ETT unknown, a fault never fired).
    (tmp_path / "launch.py").write_text(ELASTIC_FUNCTION_PROGRAM)
    _, events = _ettr_run(
        tmp_path, sys.executable, "launch.py", str(DDP_STEPS), options=("--inject", "crash@step=3,rank=1")
    )
    assert _fired(events) == [(0, 1)]
    assert _last_steps(events) == {0: 8, 1: 8}


HELPERS_THEN_TRAIN = textwrap.dedent(
    """
    import torch
    import torch.multiprocessing as mp

    def tokenize(i):  # a helper pool before training: no optimizer, no step
        torch.ones(3).sum()

    if __name__ == "__main__":
        mp.spawn(tokenize, nprocs=2)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    """
)


@pytest.mark.slow
def test_a_script_that_spawns_helpers_and_then_trains_itself_stays_the_rank(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(HELPERS_THEN_TRAIN)
    _, events = _ettr_run(tmp_path, sys.executable, "train.py", options=("--inject", "crash@step=5"))
    assert _fired(events) == [(0, 0)]  # in the script itself: the helpers never stepped, it is no launcher
    ends = [e.data["outcome"] for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends == ["failed", "completed"]


def _init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
) -> None:
    """The parameters of `torch.distributed.init_process_group` that say who joins."""


@pytest.mark.parametrize(
    ("args", "kwargs", "env", "expected"),
    [
        (("gloo",), {"rank": 1, "world_size": 2}, {}, (1, 2)),  # PyTorch's tutorial
        (("gloo", None, None, 4, 3), {}, {}, (3, 4)),  # positional
        (("gloo",), {}, {"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # env://, set by the process itself
        (("gloo", "tcp://127.0.0.1:1234?rank=2&world_size=3"), {}, {}, (2, 3)),
        (("gloo", "tcp://127.0.0.1:1234"), {"rank": 0, "world_size": 2}, {}, (0, 2)),
        (("gloo",), {"rank": 0, "world_size": 1}, {}, None),  # one process alone: no rank to become
        (("gloo",), {"rank": 2, "world_size": 2}, {}, None),  # not a place in the group
        (("gloo",), {}, {}, None),  # unknown
        (("gloo",), {"rank": "x", "world_size": 2}, {}, None),
        (("gloo",), {"nonsense": 1}, {}, None),  # a call torch would refuse: left to torch
    ],
)
def test_the_place_a_process_joins_a_group_at_comes_from_the_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], env: dict[str, str], expected: tuple[int, int] | None
) -> None:
    import inspect

    assert joining_as(inspect.signature(_init_process_group), args, kwargs, env) == expected


@pytest.mark.parametrize(
    ("env", "inherited"),
    [
        ({}, False),  # started by a program that is no rank (the tutorial's main process)
        ({"TORCHELASTIC_RUN_ID": "x"}, True),  # a helper of a torchrun rank
        ({"RANK": "1", "WORLD_SIZE": "2"}, True),
        ({"ETTR_RANK": "0", "ETTR_WORLD_SIZE": "2"}, True),  # a helper of a spawned rank
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, True),  # of an MPI rank
    ],
)
def test_a_helper_of_a_rank_never_becomes_one(env: dict[str, str], inherited: bool) -> None:
    assert inherited_rank(env) is inherited


def test_the_bootstrap_watches_the_processes_multiprocessing_starts() -> None:
    import multiprocessing.forkserver  # noqa: F401  (the name its command line runs)

    site = (ROOT / "src/ettr/bootstrap/pythonpath/sitecustomize.py").read_text()
    assert all(f'"{mark}"' in site for mark in MULTIPROCESSING_CHILD_ARGS)  # spelled out there: kept equal
    spawn_child = [sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)", "--multiprocessing-fork"]  # fmt: skip
    forkserver = [
        sys.executable,
        "-c",
        "from multiprocessing.forkserver import main; main(3, 4, ['__main__'])",
    ]
    assert started_by_multiprocessing(spawn_child) and started_by_multiprocessing(forkserver)
    assert not started_by_multiprocessing([sys.executable, "train.py"])


TUTORIAL = textwrap.dedent(
    """
    # PyTorch's "Writing Distributed Applications" tutorial: one mp.Process per rank, the rank an argument
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def run(rank, size, steps):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(  # spawned workers: helpers of the rank, never ranks
            torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4, num_workers=1,
            multiprocessing_context="spawn",
        )
        batches = [b for (b,) in loader]
        for step in range(steps):
            opt.zero_grad()
            model(batches[step % len(batches)]).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad.data)
            opt.step()

    def init_process(rank, size, port, fn):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=size)
        fn(rank, size, 12)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.set_start_method(sys.argv[2])
        processes = [mp.Process(target=init_process, args=(r, 2, int(sys.argv[1]), run)) for r in range(2)]
        for p in processes:
            p.start()
        for p in processes:
            p.join()
        sys.exit(max(abs(p.exitcode) for p in processes))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_processes_that_join_a_group_are_the_ranks_the_tutorials_way(
    tmp_path: Path, start_method: str
) -> None:
    from ettr.supervisor.launch import free_port

    (tmp_path / "train.py").write_text(TUTORIAL)
    _, events = _ettr_run(
        tmp_path,
        sys.executable,
        "train.py",
        str(free_port()),
        start_method,
        options=("--inject", "crash@step=5,rank=1"),
    )
    assert _fired(events) == [(0, 1)]  # in rank 1, not in the program that started the ranks
    assert _starts(events) == [(0, 0), (0, 0), (0, 1), (1, 0), (1, 0), (1, 1)]  # the program, then its ranks
    assert _last_steps(events) == {0: 12, 1: 12}
    failures = [(e.attempt, e.rank) for e in events if e.kind is EventKind.FAILURE]
    assert (0, 1) in failures  # recorded in the rank, although multiprocessing caught the exception
    ends = [e.data["outcome"] for e in events if e.kind is EventKind.ATTEMPT_END]
    assert ends == ["failed", "completed"]


def test_the_bootstrap_spells_the_world_names_a_launched_rank_is_told_by() -> None:
    from ettr.bootstrap.spawned import LAUNCHED_WORLD_NAMES
    from ettr.run_env import INSTRUMENTED_WORLD_ENV, MPI_RANK_NAMES

    site = (ROOT / "src/ettr/bootstrap/pythonpath/sitecustomize.py").read_text()
    assert all(f'"{name}"' in site for name in LAUNCHED_WORLD_NAMES) and f'"{INSTRUMENTED_WORLD_ENV}"' in site
    assert {size for _, size, _ in MPI_RANK_NAMES} <= set(LAUNCHED_WORLD_NAMES)


@pytest.mark.parametrize(
    ("env", "trained", "becomes"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, False, True),  # a launcher of the user's own set them
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, False, True),  # mpirun run by a program
        ({"RANK": "1", "WORLD_SIZE": "2"}, True, False),  # the program trained itself: its helper
        ({"RANK": "1", "WORLD_SIZE": "2", "ETTR_INSTRUMENTED_WORLD": "2"}, False, False),  # a rank's helper
        ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, False, False),
        ({"RANK": "0", "WORLD_SIZE": "1"}, False, False),  # one process alone
    ],
)
def test_a_process_a_lone_program_starts_as_a_rank_of_a_larger_world_is_that_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], trained: bool, becomes: bool
) -> None:
    import ettr.bootstrap.start as start_module
    from ettr.bootstrap.spawned import launched_rank
    from ettr.run_env import RunEnv

    started: list[dict[str, str]] = []
    monkeypatch.setattr(start_module, "start", lambda environ: started.append(dict(environ)))
    monkeypatch.setattr(start_module, "at_first_step", lambda action: None)
    if trained:
        path = trained_path(tmp_path, 0, 4242)
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    environ = {
        **RunEnv(run_dir=tmp_path, job_id="j", attempt=0).to_environ(),
        "ETTR_INSTRUMENTED_PID": "4242",
        "ETTR_INSTRUMENTED_WORLD": "1",
        **env,
    }
    launched_rank(environ)
    assert bool(started) is becomes
    if becomes:  # instrumented as itself: no marker of the program that started it
        assert "ETTR_INSTRUMENTED_PID" not in started[0] and "ETTR_INSTRUMENTED_WORLD" not in started[0]


LAUNCHER = textwrap.dedent(
    """
    # a user's own launcher: one Python process per rank, the rank in its environment
    import os, subprocess, sys
    port = sys.argv[1]
    procs = [
        subprocess.Popen(
            [sys.executable, sys.argv[2]],
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for r in range(2)
    ]
    sys.exit(max(p.wait() for p in procs))
    """
)


@pytest.mark.slow
def test_the_processes_a_users_own_launcher_starts_with_their_ranks_are_the_ranks(tmp_path: Path) -> None:
    from ettr.supervisor.launch import free_port

    (tmp_path / "launch.py").write_text(LAUNCHER)
    _, events = _ettr_run(
        tmp_path,
        sys.executable,
        "launch.py",
        str(free_port()),
        str(DDP_STEPS),
        options=("--inject", "crash@step=3,rank=1"),
    )
    assert _fired(events) == [(0, 1)]
    assert _last_steps(events) == {0: 8, 1: 8}
