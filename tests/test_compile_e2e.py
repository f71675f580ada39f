"""Compile support in real processes: recompile prevention across attempts and jobs (also under `ettr run`),
the store's warm start, laziness for processes that never compile, and `ettr compile-report`.

Every process gets a fresh inductor cache directory and a fresh TMPDIR (where inductor keeps precompiled
headers), so nothing warm leaks between them except through the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ettr.cli import main
from ettr.events import EventKind, Phase
from ettr.ledger import open_ledger

JOB = textwrap.dedent(
    """
    import json, os, sys
    import ettr.compile
    ettr.compile.autoinstall()          # what the bootstrap does: config and recorder from the environment
    import torch
    backend, shapes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    import ettr
    rec = ettr.get_recorder()
    train = len(sys.argv) < 4 or sys.argv[3] != "inference"
    for step, batch_size in enumerate(shapes, start=1):
        with torch.set_grad_enabled(train):
            loss = compiled(torch.randn(batch_size, 8)).square().mean()
        if train:
            loss.backward()
            opt.step()
            opt.zero_grad()
        rec.step(step)
        if len(sys.argv) > 4 and step == int(sys.argv[4]):
            rec.flush()
            os._exit(1)  # a crash: no atexit, no settle-time save
    session = ettr.compile.current_session()
    from torch._dynamo.utils import counters
    print(json.dumps({
        "restore": session.last_restore,
        "applied": [s.render() for s in session.applied_sources],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }))
    """
)


def _run_job(
    tmp_path, run_dir, attempt, *, backend, shapes="4,6,10", store=None, mode="train", crash_after=None
):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    fresh = tmp_path / f"proc-{run_dir.name}-{attempt}-{len(list(tmp_path.iterdir()))}"
    (fresh / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        "ETTR_RUN_DIR": str(run_dir),
        "ETTR_ATTEMPT": str(attempt),
        "ETTR_JOB_ID": run_dir.name,
        "ETTR_COMPILE_STORE": str(store) if store else "off",
        "ETTR_COMPILE_KEY": "tiny-mlp",
        "TMPDIR": str(fresh / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(fresh / "inductor"),
    }
    for name in ("TORCH_COMPILE_DYNAMIC_SOURCES", "TORCH_COMPILE_JOB_ID", "TORCH_LOGS"):
        env.pop(name, None)
    argv = [sys.executable, str(script), backend, shapes, mode] + ([str(crash_after)] if crash_after else [])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if crash_after:
        assert out.returncode == 1, out.stderr[-3000:]
        return None, out.stderr
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _events(run_dir):
    ledger = open_ledger(run_dir, create=False)
    try:
        return ledger.read()
    finally:
        ledger.close()


def _recompiles(run_dir, attempt):
    return [e for e in _events(run_dir) if e.kind is EventKind.RECOMPILE and e.attempt == attempt]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard: compiling at a load of 10 takes minutes
def test_three_shapes_recompile_at_most_once_then_never_again_in_later_attempts_and_jobs(tmp_path, capsys):
    store = tmp_path / "store"
    job_a = tmp_path / "job-a"
    # The first attempt crashes right after its last step: what it learned must already be on disk.
    _run_job(tmp_path, job_a, 0, backend="eager", store=store, crash_after=3)
    first = _recompiles(job_a, 0)
    assert len(first) <= 1
    assert all("size mismatch" in e.data["reason"] for e in first)
    compile_spans = [
        e
        for e in _events(job_a)
        if e.kind is EventKind.PHASE_END and e.phase is Phase.COMPILE and e.attempt == 0
    ]
    assert compile_spans and all(e.ts >= e.value for e in compile_spans)

    # The next attempt of the same job learns from the run directory ...
    result, _ = _run_job(tmp_path, job_a, 1, backend="eager", store=store)
    assert result["applied"] and all(s.endswith(":0") for s in result["applied"])  # the batch dimension only
    assert _recompiles(job_a, 1) == []
    # ... and a later job of the same workload from the store.
    job_b = tmp_path / "job-b"
    result, _ = _run_job(tmp_path, job_b, 0, backend="eager", store=store)
    assert result["restore"]["status"] == "hit" and result["applied"]
    assert _recompiles(job_b, 0) == []

    # `ettr compile-report` shows the reason and what was learned.
    assert main(["compile-report", str(job_a), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [a["num_recompiles"] for a in summary["attempts"]] == [1, 0]
    assert "size mismatch at index 0" in summary["recompile_reasons"][0]["reason"]
    assert summary["learned_dynamic_sources"] == result["applied"]
    assert main(["compile-report", str(job_a)]) == 0
    assert "TORCH_COMPILE_DYNAMIC_SOURCES=" in capsys.readouterr().out
    assert main(["compile-report", str(tmp_path / "nope")]) == 2


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard: compiling at a load of 10 takes minutes
def test_a_warm_start_from_the_store_reuses_compiled_kernels(tmp_path):
    store = tmp_path / "store"
    cold, _ = _run_job(
        tmp_path, tmp_path / "cold", 0, backend="inductor", shapes="4", store=store, mode="inference"
    )
    assert cold["restore"]["status"] == "miss" and cold["fxgraph_cache_miss"] >= 1
    saves = [
        e.data
        for e in _events(tmp_path / "cold")
        if e.kind is EventKind.MARK and e.data.get("action") == "save"
    ]
    assert saves and saves[-1]["status"] == "saved"
    assert "inductor_cache" in saves[-1]["artifacts"]
    assert saves[-1]["headers"] in ("saved", "shared")  # the build's header: in its own entry

    warm, _ = _run_job(
        tmp_path, tmp_path / "warm", 0, backend="inductor", shapes="4", store=store, mode="inference"
    )
    assert warm["restore"]["status"] == "hit"
    assert "inductor_cache" in warm["restore"]["restored"]
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0


def test_autoinstall_costs_nothing_until_torch_dynamo_is_imported(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import ettr.compile
        assert ettr.compile.autoinstall() is True
        import torch
        assert "torch._dynamo" not in sys.modules and ettr.compile.current_session() is None
        f = torch.compile(lambda x: x * 2, backend="eager")
        f(torch.ones(2))
        session = ettr.compile.current_session()
        assert session is not None and len(session.hooks.records) == 1, session
        print("ok")
        """
    )
    env = {**os.environ, "ETTR_COMPILE_STORE": "off", "TMPDIR": str(tmp_path)}
    env.pop("ETTR_RUN_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_autoinstall_is_off_when_asked(tmp_path):
    code = "import ettr.compile, sys; print(ettr.compile.autoinstall())"
    env = {**os.environ, "ETTR_COMPILE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


TRAIN = textwrap.dedent(
    """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch_size in [4, 6, 10, 4, 6, 10]:
        compiled(torch.randn(batch_size, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard: compiling at a load of 10 takes minutes
def test_under_ettr_run_a_recovered_attempt_does_not_recompile(tmp_path):
    """Zero code: the bootstrap installs compile support; attempt 0 crashes after its recompile."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "ETTR_COMPILE_STORE": str(tmp_path / "store"), "TMPDIR": str(tmp_path / "tmp")}
    for name in (
        "ETTR_RUN_DIR",
        "ETTR_ATTEMPT",
        "ETTR_JOB_ID",
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_COMPILE_DYNAMIC_SOURCES",
    ):
        env.pop(name, None)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--inject", "crash@step=3"]
    out = subprocess.run(
        [*command, "--", sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_recompiles(run_dir, 0)) == 1
    assert _recompiles(run_dir, 1) == []
    spans = {
        e.attempt for e in _events(run_dir) if e.kind is EventKind.PHASE_END and e.phase is Phase.COMPILE
    }
    assert spans == {0, 1}
