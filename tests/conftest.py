"""Shared fixtures: a throwaway PostgreSQL server for the ledger tests (session-scoped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test (and every process it starts) gets a fresh per-user cache: the compile store and the fleet's
    summary cache default to $XDG_CACHE_HOME/ettr, which would otherwise carry entries from earlier runs into
    tests that expect an empty store. Likewise a fresh $XDG_CONFIG_HOME, where the checkpoint key ring lives
    by default (ettr.checkpoint.keys), so that no test, nor any process a test starts with the ETTR_*
    variables left out, makes or reads keys in the real ~/.config."""
    fresh = {
        "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache")),
        "XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("xdg-config")),
    }
    previous = {name: os.environ.get(name) for name in fresh}
    os.environ.update(fresh)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True, scope="session")
def _private_memory_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Memory copies of checkpoints (`ettr.checkpoint.memory`) go to a directory of the test session, not to
    the machine's /dev/shm, where the copies of jobs a test kills would otherwise be left behind."""
    previous = os.environ.get("ETTR_MEMORY_DIR")
    os.environ["ETTR_MEMORY_DIR"] = str(tmp_path_factory.mktemp("ettr-memory"))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("ETTR_MEMORY_DIR", None)
        else:
            os.environ["ETTR_MEMORY_DIR"] = previous


@pytest.fixture(autouse=True)
def _no_compile_session_from_in_process_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that installs the zero-code hooks in the test process (`AutoHooks.on_torch`) would arm this
    process's one compile session for good: the next test to import torch._dynamo starts it, and its settle
    save, seconds later, writes its store line to the stderr of whichever test runs then (CI failed so:
    test_cli_trace_refuses_several_run_dirs read two lines). In-process hooks leave compile support alone;
    the compile tests run it in processes of their own, and a test may still patch `autoinstall` itself."""
    import ettr.compile

    monkeypatch.setattr(ettr.compile, "autoinstall", lambda *args, **kwargs: False)


@pytest.fixture
def in_process_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any]]:
    """ettr's zero-code hooks installed in this process on a real recorder: (hooks, recorder, ledger). Removed
    again at the end, when every torch attribute they patch must be torch's own again. The process counts as
    one that compiled nothing (another test may have compiled with Dynamo, after which evaluations are not
    timed: `EvalHooks._hookable`)."""
    torch = pytest.importorskip("torch")
    from ettr import torch_compat
    from ettr.bootstrap.hooks import AutoHooks
    from ettr.ledger import open_ledger
    from ettr.recorder import Recorder

    monkeypatch.setattr(torch_compat, "dynamo_frames_compiled", lambda: 0)
    base = torch_compat.dataloader_iter_base()
    patched = [(torch.nn.Module, name) for name in ("train", "eval", "__getstate__")]
    patched += [(base, "__next__"), (base, "__init__")]
    originals = [owner.__dict__[name] for owner, name in patched]
    ledger = open_ledger(tmp_path / "run")
    rec = Recorder(ledger, run_dir=tmp_path / "run", attempt=0, rank=0)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    try:
        yield hooks, rec, ledger
    finally:
        hooks.uninstall()
        rec.close()
        assert [owner.__dict__[name] for owner, name in patched] == originals


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _required(what: str, found: object, how: str) -> None:
    """Outside CI a machine without `what` skips the test; under CI (`CI=true`) that is a failure: `make test`
    installs it (`how`)."""
    if found:
        return
    if _in_ci():
        pytest.fail(f"CI=true but no {what}: {how}")
    pytest.skip(f"no {what} ({how})")


@pytest.fixture
def mpirun() -> str:
    """Open MPI's `mpirun` (`make mpi` installs Debian's)."""
    import shutil

    found = shutil.which("mpirun")
    _required("mpirun", found, "`make mpi` installs Open MPI")
    return str(found)


DEEPSPEED_DIR = Path(__file__).resolve().parents[1] / ".venv" / "deepspeed"
"""Where the Makefile installs DeepSpeed, off the venv's path (on it, transformers and accelerate would take it up)."""


@pytest.fixture
def deepspeed_launcher() -> Path:
    """DeepSpeed's `deepspeed` console script in `DEEPSPEED_DIR/bin` (its package needs `DEEPSPEED_DIR`,
    `launcher.parents[1]`, on PYTHONPATH)."""
    launcher = DEEPSPEED_DIR / "bin" / "deepspeed"
    _required(f"DeepSpeed in {DEEPSPEED_DIR}", launcher.exists(), "`make install` puts it there")
    return launcher


def start_postgres_or_skip() -> object:
    """A started private PostgreSQL server (`tests/pg_server.py`: `PostgresServer`); the caller removes it.

    Outside CI a machine that cannot start one skips the test with the reason; under CI (`CI=true`) that
    is a failure: the project's CI provides the server.
    """
    from pg_server import PostgresServer, PostgresUnavailable

    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        if _in_ci():
            pytest.fail(f"CI=true but psycopg is not installed ({exc}); install '.[postgres]'")
        pytest.skip("psycopg 3 is not installed (pip install 'ettr[postgres]')")
    try:
        server = PostgresServer()
        server.start()
    except PostgresUnavailable as exc:
        if _in_ci():
            pytest.fail(f"CI=true but no PostgreSQL server could be started: {exc}")
        pytest.skip(f"no PostgreSQL server can be started here ({exc}); `make postgres` installs one")
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[object]:
    """The session's PostgreSQL server, removed at the end (see `start_postgres_or_skip`)."""
    server = start_postgres_or_skip()
    try:
        yield server
    finally:
        server.remove()  # type: ignore[attr-defined]


@pytest.fixture
def private_postgres() -> Iterator[object]:
    """A PostgreSQL server of this test alone (it may stop and start it)."""
    server = start_postgres_or_skip()
    try:
        yield server
    finally:
        server.remove()  # type: ignore[attr-defined]


@pytest.fixture
def postgres_url(postgres_server: object) -> str:
    """The URL of the session's PostgreSQL server (a fresh database per test keeps tests apart)."""
    import uuid

    import psycopg

    from pg_server import PostgresServer

    assert isinstance(postgres_server, PostgresServer)
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return postgres_server.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[object]:
    """A single-node Slurm cluster for the session (`tests/slurm_cluster.py`: `SlurmCluster`), removed at the end.

    Outside CI a machine that cannot start one (not root, no slurm packages) skips the test with the reason;
    under CI (`CI=true`) that is a failure: `make test` runs `make slurm`, which installs the daemons.
    """
    from slurm_cluster import SlurmCluster, SlurmUnavailable

    cluster = SlurmCluster()
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.remove()
        if _in_ci():
            pytest.fail(f"CI=true but no Slurm cluster could be started: {exc}")
        pytest.skip(f"no Slurm cluster can be started here ({exc}); `make slurm` installs the daemons")
    try:
        yield cluster
    finally:
        cluster.remove()


# Slow files that run in the benchmarks' group instead of the slow one, to even out the two chains: in the full
# suite at load 8-18 the slow chain's tests took 5,435+ s and the benchmarks' quick modes 1,824 s, so one worker
# ran heavy tests one after another while the other ran out of work (these three: 1,458 s of that run).
_SLOW_FILES_WITH_THE_BENCHMARKS = frozenset(
    {"tests/test_demo.py", "tests/test_integrations_hf.py", "tests/test_multinode.py"}
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers with `--dist loadgroup`) the slow tests -- real
    multi-process jobs, each of which keeps the machine busy -- run in two chains, one test at a time in each
    (one chain holds the benchmarks' quick modes, which check that each benchmark runs, not its figures): so
    never more than two such jobs at once, as with the slow tests beside a benchmark before. The many small tests
    fill in. Without xdist the marker means nothing."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            path = item.nodeid.split("::", 1)[0]
            benchmarks = path == "tests/test_benchmarks.py" or path in _SLOW_FILES_WITH_THE_BENCHMARKS
            item.add_marker(pytest.mark.xdist_group("benchmarks" if benchmarks else "slow"))


@pytest.fixture(scope="session")
def uninterrupted_resilient_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final parameters' digest of `ettr.testing.resilient_job` run without a fault under torchrun (2 ranks,
    its defaults, no ettr): what every recovered run of it must end with (tests/test_inplace.py, test_spares)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ettr.testing.resilient_job", "--ckpt-dir", str(work / "ckpt"), "--timings", str(work / "log.jsonl"),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (work / "log.jsonl").read_text().splitlines()
    digests = {json.loads(x)["digest"] for x in lines if '"done"' in x}
    assert len(digests) == 1
    return digests.pop()
