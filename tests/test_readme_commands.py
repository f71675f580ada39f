"""The README's command lines run as written.

Every line of the README's plain ``` blocks that starts with `ettr ` (the quick start and its tour of commands)
is run in a fresh directory that holds the project's `examples/`, in the README's order, through the installed
`ettr` command. Only what a reader must fill in is filled in: `runs/<job-id>` becomes the run directory the
previous `ettr run` printed, `runs/a runs/b` two such runs, `[--flag ...]` each option once and without it, and
`ettr serve`'s port a free one (the server is scraped once and stopped). Lines that name a server of the
reader's own (`db.example.com`, `NODE0:PORT`) or a torchrun elided with `...` are left to tests/test_ledger_url.py
and tests/test_multinode.py, which run the same commands against real servers.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"(<!-- test: run -->\n)?```([a-z]*)\n(.*?)```", re.DOTALL)
_OPTIONAL = re.compile(r"\s*\[([^\[\]]+)\]")
_NOT_HERE = ("db.example.com", "NODE0:PORT", " ... ")


def readme_commands() -> list[str]:
    """The `ettr ...` lines of the README's plain blocks, comments removed, in order."""
    lines = []
    for match in _FENCE.finditer((ROOT / "README.md").read_text()):
        if match.group(1) or match.group(2):  # a runnable python block: tests/test_docs_examples.py runs it
            continue
        for raw in match.group(3).splitlines():
            line = raw.split("#", 1)[0].strip()
            if line.startswith("ettr ") and not any(mark in line for mark in _NOT_HERE):
                lines.append(line)
    return lines


def test_the_readme_shows_the_commands_a_reader_is_told_to_run() -> None:
    commands = readme_commands()
    for first_word in ("run", "report", "interval", "simulate", "fleet", "serve", "compile-report"):
        assert any(line.split()[1] == first_word for line in commands), first_word


def _variants(line: str) -> list[str]:
    """`a [--x] [--y v]` -> `a`, `a --x`, `a --y v`: each optional part once, and none."""
    parts = _OPTIONAL.findall(line)
    bare = _OPTIONAL.sub("", line)
    return [bare] + [f"{bare} {part}" for part in parts]


def _run_dir(stdout_and_err: str, cwd: Path) -> str:
    """The run directory an `ettr run` says it wrote (its last `runs/...` mention)."""
    found = re.findall(r"(runs/[A-Za-z0-9._-]+)", stdout_and_err)
    assert found, stdout_and_err[-2000:]
    run = found[-1]
    assert (cwd / run).is_dir(), run
    return run


def _serve(argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    from ettr.supervisor.launch import free_port

    port = free_port()
    argv = [str(port) if prev == "--port" else a for prev, a in zip(["", *argv], argv, strict=False)]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                    body = reply.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert reply.status == 200 and "ettr_" in body, body[:2000]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a dozen commands, each a fresh interpreter; a loaded machine takes minutes
def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    ettr = shutil.which("ettr", path=str(Path(sys.executable).parent))
    assert ettr, "the ettr command is not installed beside this python"
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["PATH"] = os.pathsep.join([str(Path(ettr).parent), env.get("PATH", "")])
    env["ETTR_STANDBY"] = "0"  # a reader's machine has cores to spare; this one is shared: cold starts only
    runs: list[str] = []
    ran = []
    for line in readme_commands():
        if "runs/a runs/b" in line:
            assert len(runs) >= 2, "the README compares two runs before it has made two"
            line = line.replace("runs/a runs/b", f"{runs[-2]} {runs[-1]}")
        if "runs/<job-id>" in line:
            assert runs, f"{line}: no run yet"
            line = line.replace("runs/<job-id>", runs[-1])
        for variant in _variants(line):
            argv = shlex.split(variant)
            ran.append(variant)
            if argv[1] == "serve":
                _serve(argv, tmp_path, env)
                continue
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            said = done.stdout + done.stderr
            ok = (0, 1) if "--check" in argv else (0,)  # --check: 1 means "regressions found", as documented
            assert done.returncode in ok, f"{variant}\n-> exit {done.returncode}\n{said[-3000:]}"
            # ettr itself never shows a traceback; a DDP job's own ranks may (torchrun prefixes their lines with
            # [rankN]:): the peer of the rank whose crash the README injects fails its collective
            ours = [ln for ln in said.splitlines() if not re.match(r"\[(default)?rank\d+\]:", ln)]
            assert not any("Traceback" in ln for ln in ours), f"{variant}\n{said[-3000:]}"
            if argv[1] == "run":
                runs.append(_run_dir(said, tmp_path))
                # a fault the README injects fires: not one lost on a checkpoint an earlier line finished
                assert "never fired" not in said, f"{variant}\n{said[-3000:]}"
    assert len(ran) >= 12, ran
