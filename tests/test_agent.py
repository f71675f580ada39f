"""ettr's own torchrun agent: a torchrun command line read into a worker spec, the fallbacks, the workers'
environment (`ettr.supervisor.agent`). Pure and fast; the real restart is in test_agent_restart.py."""

from __future__ import annotations

import os
import stat
import sys
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
