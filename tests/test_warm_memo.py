"""A new job's zygote imports what the same script's workers had imported by their first step when it last ran
on this node (`ettr.supervisor.warm_memo`): remembered by the agent at the job's end, read as the requeue's
first-step markers are (only `warmable` names; a forged file names nothing the zygote would run), and
inductor's precompiled-header directory of a process whose inductor a warm-up imported is where a cold start's
would be (`torch_compat.inductor_refix_header_dir`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest

ARGV = [sys.executable, "-u", "train.py", "--steps", "60"]


@pytest.fixture
def envs(tmp_path: Path) -> list[dict[str, str]]:
    return [{"XDG_CACHE_HOME": str(tmp_path / "cache"), "RANK": str(r)} for r in range(2)]


def test_what_the_last_attempt_imported_is_remembered_for_the_scripts_next_job(tmp_path, envs, monkeypatch):
    from ettr.run_env import trained_path
    from ettr.supervisor import agent, standby_group, zygote
    from ettr.supervisor.worker_kind import WorkerGroupKind

    run_dir = tmp_path / "run"
    marker = trained_path(run_dir, 2, 42)
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"modules": ["torch.distributed", "torch._inductor.compile_fx", "numpy"]}))
    kind = WorkerGroupKind(
        agent.WorkerSpec(nproc=2, argv=tuple(ARGV)), run_dir=run_dir, max_restarts=0, teardown_grace_s=1
    )
    kind._workers, kind._attempt = ([list(ARGV)] * 2, envs), 2  # what `start` keeps of the last attempt
    kind.discard()  # the job ends
    (remembered,) = (tmp_path / "cache" / "ettr" / "warm").iterdir()
    assert oct(remembered.stat().st_mode & 0o777) == "0o600"

    started: list[list[str]] = []

    def start(cls, argv, env, *, modules=()):
        started.append(list(modules))
        return "not started here"

    monkeypatch.setattr(zygote.Zygote, "start", classmethod(start))
    # The next job of the same script (other arguments, a new run directory): its attempt 0's zygote.
    other_args = [[*ARGV[:3], "--steps", "2400"]] * 2
    assert standby_group.start_zygote(other_args, envs, run_dir=tmp_path / "next", attempt=0) is None
    assert started[-1] == ["numpy", "torch._inductor.compile_fx", "torch.distributed"]
    # Another script, or the memo turned off: what any job imports (`WARM_MODULES`).
    other_script = [[sys.executable, "-u", "eval.py"]] * 2
    assert standby_group.start_zygote(other_script, envs, run_dir=tmp_path / "x", attempt=0) is None
    assert started[-1] == list(standby_group.WARM_MODULES)
    off = [dict(e, ETTR_WARM_MEMO="0") for e in envs]
    assert standby_group.start_zygote(other_args, off, run_dir=tmp_path / "y", attempt=0) is None
    assert started[-1] == list(standby_group.WARM_MODULES)


def test_a_forged_memo_never_names_a_module_the_zygote_would_run(tmp_path, envs, monkeypatch):
    from ettr.supervisor import warm_memo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "evilmod.py").write_text("raise SystemExit('imported')\n")  # the working directory's
    path = warm_memo.memo_path(ARGV, str(tmp_path), envs[0])
    assert path is not None
    path.parent.mkdir(parents=True)
    forged = ["evilmod", "this", "unittest.__main__", "torch._C", "torch.utils.bottleneck.__main__", "os", 3]
    path.write_text(json.dumps({"modules": [*forged, "torch.distributed", "torch._dynamo", "numpy"]}))
    assert warm_memo.recall([ARGV], envs) == ["torch.distributed", "torch._dynamo", "numpy"]
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"modules": ["numpy"]}))
    assert warm_memo.recall([ARGV], envs) == []  # never through a symlink
    path.unlink()
    os.mkfifo(path)  # would block the agent's read for good
    assert warm_memo.recall([ARGV], envs) == []
    warm_memo.remember([ARGV], envs, ["numpy"])  # a FIFO there: not replaced, never raises
    assert warm_memo.script_of([sys.executable, "-c", "pass"], "/") is None
    assert warm_memo.script_of([sys.executable, "-m", "pkg.train", "x"], "/w") == [
        sys.executable,
        "-m",
        "pkg.train",
        "/w",
    ]


def _fake_codecache(header_dir: str, looked_up: int) -> types.SimpleNamespace:
    lookup = types.SimpleNamespace(cache_info=lambda: types.SimpleNamespace(currsize=looked_up))
    return types.SimpleNamespace(
        _HEADER_DIR=header_dir, _HEADER_LOCK_DIR=os.path.join(header_dir, "locks"), _precompile_header=lookup
    )


def test_a_warm_processs_header_directory_follows_the_tmpdir_its_script_set_before_compiling(
    tmp_path, monkeypatch
):
    """Inductor fixes its precompiled-header directory from TMPDIR at its codecache's import; a zygote's warm-up
    imported it before the script pointed TMPDIR at fresh local caches (the demo's `--compile-cache`), and the
    worker then looked up, built, restored and saved its headers in the node's shared default directory."""
    from ettr import torch_compat

    pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    imported = str(tmp_path / "zygote-tmp" / "torchinductor_x" / "precompiled_headers")
    fake = _fake_codecache(imported, looked_up=0)
    monkeypatch.setitem(sys.modules, "torch._inductor.codecache", fake)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "attempt-0"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # as the script does after setting TMPDIR
    (tmp_path / "attempt-0").mkdir()
    moved = torch_compat.inductor_refix_header_dir()
    assert moved is not None and Path(moved).parent.parent == tmp_path / "attempt-0"
    assert fake._HEADER_DIR == moved == torch_compat.inductor_header_dir()
    assert fake._HEADER_LOCK_DIR == os.path.join(moved, "locks")
    # A header was looked up already: it stays where it is (the process would split its headers).
    used = _fake_codecache(imported, looked_up=1)
    monkeypatch.setitem(sys.modules, "torch._inductor.codecache", used)
    assert torch_compat.inductor_refix_header_dir() is None and used._HEADER_DIR == imported
    monkeypatch.delitem(sys.modules, "torch._inductor.codecache")
    assert torch_compat.inductor_refix_header_dir() is None  # not imported: nothing to put right


@pytest.mark.parametrize("warm", [True, False])
def test_the_compile_session_puts_the_header_directory_right_only_after_a_warm_up(
    tmp_path, monkeypatch, warm
):
    import importlib

    from ettr.compile import isa_probe, lazy_templates, pch_memo
    from ettr.compile import session as session_module
    from ettr.compile.session import CompileConfig
    from ettr.ledger import MemoryLedger
    from ettr.recorder import Recorder

    autoinstall = importlib.import_module("ettr.compile.autoinstall")  # the package's name is the function
    calls: list[str] = []
    monkeypatch.setattr(session_module, "_header_dir_as_a_cold_start", lambda: calls.append("header dir"))
    patched = ((lazy_templates, "defer"), (isa_probe, "share"), (pch_memo, "share"))
    for module, name in (*patched, (session_module.torch_compat, "prefetch_inductor_torch_key")):
        monkeypatch.setattr(module, name, lambda *a, **k: False)
    monkeypatch.setattr(autoinstall, "_warm_imports_only", warm)  # `after_warm_up`: a zygote's or standby's
    monkeypatch.setattr(autoinstall, "CompileSession", _NotStarted.wrap(session_module.CompileSession))
    rec = Recorder(MemoryLedger(), run_dir=tmp_path / "run", flush_interval_s=60)
    monkeypatch.setattr(autoinstall, "_session", None)
    autoinstall._start_session(rec, CompileConfig(store=None, save_at_exit=False))
    made = autoinstall._session
    monkeypatch.setattr(autoinstall, "_session", None)
    assert made is not None
    made._on_torch_compile()  # the script's first torch.compile
    assert calls == (["header dir"] if warm else [])
    made.close()
    rec.close()


class _NotStarted:
    """`CompileSession` whose `start` does nothing (no hooks on torch, no thread): the test calls its parts."""

    @staticmethod
    def wrap(cls):
        class Session(cls):
            def start(self):
                pass

        return Session
