"""The fleet dashboard: self-contained (no network), the regression and every family shown, and it renders
in headless Chromium with its script run to the end (skipped where Chromium is absent and cannot be
installed, as tests/test_report_html.py does)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ettr.fleet.aggregate import build_fleet
from ettr.fleet.html import render_html, write_html
from ettr.fleet.load import find_run_dirs, load_run_dirs
from ettr.fleet.regress import find_regressions
from ettr.testing.fleet import JobSpec, write_job

T0 = 1_700_000_000.0
EVIL = "<script>alert(1)</script>"


@pytest.fixture
def fleet(tmp_path):
    for i in range(6):
        spec = JobSpec(job_id=f"a{i}", family=EVIL if i == 0 else "alpha", start_ts=T0 + i * 50_000,
                       compile_s=6.0 if i >= 4 else 3.0)  # fmt: skip
        write_job(tmp_path / "runs" / f"a{i}", spec)
    for i in range(4):
        spec = JobSpec(job_id=f"b{i}", family="beta", start_ts=T0 + i * 40_000, world_size=2,
                       fail_at_steps=(50,) if i == 1 else ())  # fmt: skip
        write_job(tmp_path / "runs" / f"b{i}", spec)
    jobs, _ = load_run_dirs(find_run_dirs([tmp_path / "runs"]), now=T0)
    return build_fleet(jobs, find_regressions(jobs))


def test_dashboard_is_self_contained_and_escaped(fleet):
    page = render_html(fleet)
    assert EVIL not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert page.count('class="regression"') == len(fleet.regressions) >= 1
    assert page.count("regression-mark") == len({r.job_id for r in fleet.regressions})
    for family in fleet.families:
        if family != EVIL:
            assert f">{family}<" in page
    assert render_html(fleet) == page  # deterministic


def _chromium() -> str:
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
    )
    if path:
        return path
    pytest.skip("chromium is not installed (`make chromium` installs it as root)")


@pytest.mark.slow
def test_dashboard_renders_in_headless_chromium(fleet, tmp_path):
    page = tmp_path / "fleet.html"
    write_html(fleet, page)
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
           "--v=0", "--dump-dom", page.as_uri()]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert errors == []
    dom = result.stdout
    assert 'data-ettr-script="ok"' in dom  # the inline script ran to its end
    charts = int(dom.split('data-ettr-charts="', 1)[1].split('"', 1)[0])
    assert charts >= 6
    assert dom.count('class="job-point"') == len(fleet.jobs)
    shot = tmp_path / "shot.png"
    result = subprocess.run([*cmd[:-2], f"--screenshot={shot}", "--window-size=1100,1800", page.as_uri()],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode == 0 and shot.stat().st_size > 20_000, result.stderr[-2000:]
    if os.environ.get("ETTR_KEEP_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["ETTR_KEEP_SCREENSHOT"]))
