"""The run contract: RunEnv round-trips through the environment, and the bootstrap's copy of the names agrees."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from ettr import run_env
from ettr.bootstrap import pythonpath_dir
from ettr.run_env import (
    INSTRUMENTED_ENV,
    LAUNCHER_ENV,
    RUN_DIR_ENV,
    TORCHELASTIC_RUN_ID_ENV,
    Launcher,
    RankEnv,
    RunEnv,
    heartbeat_dir,
    heartbeat_path,
)
from ettr.supervisor.launch import attempt_launch


def _full() -> RunEnv:
    return RunEnv(
        run_dir=Path("/runs/j"),
        job_id="j",
        attempt=2,
        supervisor_pid=41,
        attempt_started_at=1700000000.25,
        inject='[{"kind": "crash"}]',
        auto=False,
        launcher=Launcher.TORCHRUN,
        instrumented_pid=77,
        ledger_url="sqlite:///tmp/x.db",
        family="dlrm",
    )


def test_every_field_round_trips_through_the_environment():
    env = _full()
    assert RunEnv.from_environ(env.to_environ()) == env
    minimal = RunEnv(run_dir=Path("/r"))
    assert RunEnv.from_environ(minimal.to_environ()) == minimal
    assert set(minimal.to_environ()) == {"ETTR_RUN_DIR", "ETTR_JOB_ID", "ETTR_ATTEMPT", "ETTR_AUTO"}


def test_every_name_is_an_ettr_name_and_none_is_spelled_twice():
    names = [v for k, v in vars(run_env).items() if k.endswith("_ENV") and isinstance(v, str)]
    ours = [n for n in names if n.startswith(run_env.ENV_PREFIX)]
    assert len(ours) == len(set(ours))
    assert {"ETTR_RUN_DIR", "ETTR_JOB_ID", "ETTR_ATTEMPT", "ETTR_LEDGER", "ETTR_FAMILY"} <= set(ours)
    assert set(_full().to_environ()) <= set(ours)


def test_outside_a_run_there_is_no_run_env_and_bad_numbers_read_as_defaults():
    assert RunEnv.from_environ({}) is None
    assert RunEnv.from_environ({"ETTR_RUN_DIR": ""}) is None
    env = RunEnv.from_environ(
        {
            "ETTR_RUN_DIR": "/r",
            "ETTR_ATTEMPT": "x",
            "ETTR_SUPERVISOR_PID": "-3",
            "ETTR_ATTEMPT_STARTED_AT": "soon",
            "ETTR_LAUNCHER": "mpirun",
        }
    )
    assert env == RunEnv(run_dir=Path("/r"))
    assert RankEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == RankEnv(
        rank=3, world_size=4, local_rank=1
    )
    assert RankEnv.from_environ({"RANK": "?"}) == RankEnv()
    # RANK=-1 made a training process's events read as the supervisor's (SUPERVISOR_RANK): a job without a
    # step, nothing said; a world of 0 processes, '²' (str.isdigit, not int), more than 4,300 digits: no rank
    for junk in ("-1", "-7", "²", "9" * 5000, "1e3", ""):
        assert RankEnv.from_environ({"RANK": junk, "LOCAL_RANK": junk, "WORLD_SIZE": junk}) == RankEnv()
        assert RankEnv.from_environ(
            {"ETTR_RANK": junk, "ETTR_RANK_BASE": junk, "LOCAL_RANK": "1"}
        ) == RankEnv(local_rank=1)
    assert RankEnv.from_environ({"RANK": " 2 ", "WORLD_SIZE": "0"}) == RankEnv(rank=2)
    assert RunEnv.from_environ({"ETTR_RUN_DIR": "/r", "ETTR_ATTEMPT": "-3"}) == RunEnv(run_dir=Path("/r"))


def test_a_process_an_mpi_launcher_started_takes_its_rank_from_the_launcher() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert RankEnv.from_environ(ompi) == RankEnv(rank=3, world_size=4, local_rank=1)
    hydra = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}
    assert RankEnv.from_environ(hydra) == RankEnv(rank=2, world_size=3, local_rank=0)
    # torchrun's names, where the script (or a launcher under mpirun) set them, come first
    assert RankEnv.from_environ({**ompi, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) == RankEnv(
        rank=0, world_size=2, local_rank=0
    )
    # a task of an srun step is Slurm's (srun --mpi=pmi2 sets PMI_RANK too, the same)
    slurm = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
    }
    assert RankEnv.from_environ(slurm) == RankEnv(rank=1, world_size=2, local_rank=1)
    assert RankEnv.from_environ({"PMI_RANK": "1"}) == RankEnv()  # no size: not an MPI world
    with pytest.raises(ValueError, match="attempt"):
        RunEnv(run_dir=Path("/r"), attempt=-1)


def test_training_process_rules():
    plain = RunEnv(run_dir=Path("/r"), launcher=Launcher.PYTHON)
    assert plain.is_training_process({}, 5)
    child = RunEnv(run_dir=Path("/r"), launcher=Launcher.PYTHON, instrumented_pid=4)
    assert not child.is_training_process({}, 5) and child.is_training_process({}, 4)
    torchrun = RunEnv(run_dir=Path("/r"), launcher=Launcher.TORCHRUN)
    assert not torchrun.is_training_process({}, 5)  # the agent
    assert torchrun.is_training_process({TORCHELASTIC_RUN_ID_ENV: "x"}, 5)  # a worker


def test_the_launcher_writes_the_run_env_and_clears_what_must_not_leak(tmp_path):
    launch = attempt_launch(
        ["python", "train.py"],
        run_dir=tmp_path,
        job_id="j",
        attempt=1,
        started_at=12.5,
        auto=False,
        base_env={"ETTR_INJECT": "[]", INSTRUMENTED_ENV: "9", "ETTR_LEDGER": "sqlite:///x", "KEEP": "1"},
    )
    env = RunEnv.from_environ(launch.env)
    assert env == RunEnv(
        run_dir=tmp_path,
        job_id="j",
        attempt=1,
        supervisor_pid=os.getpid(),
        attempt_started_at=12.5,
        auto=False,
        launcher=Launcher.PYTHON,
    )
    assert launch.env["KEEP"] == "1" and launch.env["PYTHONPATH"].startswith(str(pythonpath_dir()))
    shared = attempt_launch(
        ["python", "train.py"],
        run_dir=tmp_path,
        job_id="j",
        attempt=0,
        started_at=1.0,
        ledger_url="postgresql://db/ettr",
        family="dlrm",
        base_env={},
    )
    env = RunEnv.from_environ(shared.env)
    assert env is not None and (env.ledger_url, env.family) == ("postgresql://db/ettr", "dlrm")


def test_sitecustomize_spells_the_same_names_as_the_contract():
    tree = ast.parse((pythonpath_dir() / "sitecustomize.py").read_text())
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    env_like = {s for s in literals if s.isupper() and "_" in s and " " not in s}
    from ettr.bootstrap.spawned import LAUNCHED_WORLD_NAMES
    from ettr.run_env import INSTRUMENTED_WORLD_ENV

    assert env_like == {
        RUN_DIR_ENV,
        INSTRUMENTED_ENV,
        INSTRUMENTED_WORLD_ENV,
        LAUNCHER_ENV,
        TORCHELASTIC_RUN_ID_ENV,
        *LAUNCHED_WORLD_NAMES,
    }
    assert Launcher.TORCHRUN.value in literals


def test_heartbeat_layout():
    assert heartbeat_dir("/r", 3) == Path("/r/heartbeats/attempt-3")
    assert heartbeat_path("/r", 3, 1, pid=42) == Path("/r/heartbeats/attempt-3/rank-1-pid-42")
    assert heartbeat_path("/r", 0, 0).name == f"rank-0-pid-{os.getpid()}"


@pytest.mark.parametrize("text", ["²", "①", "1" * 5000, "-3", "7x", ""])
def test_a_number_written_by_someone_else_is_whole_ascii_digits_or_none(text):
    """`'²'.isdigit()` is True and `int('²')` raises: ETTR_SUPERVISOR_PID=² raised ValueError out of the
    training script's first `ettr.step` (RunEnv.from_environ, which never raises), and a file named
    `unrecorded-steps-²` out of the supervisor's start-up wait (`unrecorded_trainers`)."""
    from ettr.supervisor.watchdog import heartbeat_pids
    from ettr.untrusted import whole_number

    assert whole_number(text) is None
    env = RunEnv.from_environ(
        {"ETTR_RUN_DIR": "/r", "ETTR_SUPERVISOR_PID": text, "ETTR_INSTRUMENTED_PID": text}
    )
    assert env is not None and env.supervisor_pid is None and env.instrumented_pid is None
    assert heartbeat_pids([f"rank-0-pid-{text}"]) == []


def test_unrecorded_trainers_skips_names_that_are_no_pid(tmp_path):
    from ettr.untrusted import whole_number

    agent = run_env.agent_dir(tmp_path, 0)
    agent.mkdir(parents=True)
    for tail in ("²", "12", "x", "1" * 5000):
        (agent / (run_env.UNRECORDED_PREFIX + tail[:200])).write_text("")
    assert run_env.unrecorded_trainers(tmp_path, 0) == [12, int("1" * 200)]
    assert whole_number("0012") == 12


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400"])
def test_an_attempt_start_that_is_no_time_is_unknown(text):
    # The injector counts time=S from it: a NaN origin fired a time fault at once, an infinite one raised
    # OverflowError in its timer thread (a traceback in the training process).
    env = RunEnv.from_environ({"ETTR_RUN_DIR": "/r", "ETTR_ATTEMPT_STARTED_AT": text})
    assert env is not None and env.attempt_started_at is None
