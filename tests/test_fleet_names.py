"""Names a person can map back: where the fleet shows a job to a person (text, HTML, regressions, /metrics),
a job whose id was generated (`job-20261202-012743-11158`) is shown with its run directory's name; the JSON
keeps `job_id` and adds `name`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ettr.cli import main
from ettr.fleet.model import job_label
from ettr.testing.fleet import JobSpec, write_job

T0 = 1_700_000_000.0
ETTR = [sys.executable, "-m", "ettr.cli"]


def _generated(i: int) -> str:
    return f"job-20261202-01274{i}-1115{i}"


@pytest.fixture
def runs(tmp_path):
    """Six jobs with generated ids in named run directories (compile doubles from the fifth: a regression),
    and one whose run directory is named after its id, as `ettr run --job-id` alone makes it."""
    for i in range(6):
        spec = JobSpec(job_id=_generated(i), family="resnet", start_ts=T0 + i * 1000,
                       compile_s=6.0 if i >= 4 else 3.0)  # fmt: skip
        write_job(tmp_path / "runs" / f"resnet-lr{i}", spec)
    write_job(tmp_path / "runs" / "exp7", JobSpec(job_id="exp7", family="other", start_ts=T0 + 50))
    return tmp_path / "runs"


def test_the_label_is_the_name_beside_an_id_that_does_not_say_it():
    assert job_label("job-20261202-012743-11158", "resnet-lr3") == "resnet-lr3 (job-20261202-012743-11158)"
    assert job_label("exp7", "exp7") == "exp7"
    assert job_label("exp7", "") == "exp7"


def test_text_html_and_json_show_the_run_directorys_name(runs, tmp_path, capsys):
    page = tmp_path / "fleet.html"
    assert main(["fleet", str(runs), "--json", "--html", str(page)]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {j["job_id"]: j["name"] for j in out["jobs"]}
    assert names == {**{_generated(i): f"resnet-lr{i}" for i in range(6)}, "exp7": "exp7"}
    (regression,) = [r for r in out["regressions"] if r["metric"] == "compile"]
    assert (regression["job_id"], regression["name"]) == (_generated(4), "resnet-lr4")
    assert {w["name"] for w in out["worst_jobs"]} <= set(names.values())

    html = page.read_text()
    assert f"resnet-lr4 ({_generated(4)})" in html
    assert "exp7 (exp7)" not in html

    assert main(["fleet", str(runs), "--check"]) == 1
    text = capsys.readouterr().out
    assert f"resnet: compile 3.00 s -> 6.00 s from job resnet-lr4 ({_generated(4)})" in text
    worst = text.split("worst jobs (lowest ETT%)", 1)[1].split("regressions", 1)[0]
    assert "resnet-lr" in worst and "exp7 (exp7)" not in worst


def test_metrics_carry_the_name_as_a_label(runs):
    pytest.importorskip("prometheus_client")
    from ettr.fleet.load import load_run_dirs
    from ettr.fleet.metrics import metric_families

    jobs, problems = load_run_dirs(sorted(runs.iterdir()), now=T0 + 10_000)
    assert not problems
    (ratio,) = [m for m in metric_families(jobs, T0 + 10_000) if m.name == "ettr_effective_training_ratio"]
    labels = {s.labels["job"]: s.labels["name"] for s in ratio.samples}
    assert labels[_generated(2)] == "resnet-lr2" and labels["exp7"] == "exp7"


def test_a_job_read_from_a_shared_ledger_is_named_after_the_run_directory_it_ran_in(tmp_path):
    """No run directory is read here: the name comes from the run directory the supervisor recorded."""
    url = f"sqlite:///{tmp_path / 'books.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    run = subprocess.run(
        [*ETTR, "run", "--run-dir", str(tmp_path / "runs" / "bert-warmup"), "--ledger", url, "--",
         sys.executable, "-c", "import ettr; ettr.step(1)"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    done = subprocess.run(
        [*ETTR, "fleet", "--ledger", url, "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    (job,) = json.loads(done.stdout)["jobs"]
    assert job["job_id"].startswith("job-") and job["name"] == "bert-warmup"
    text = subprocess.run(
        [*ETTR, "fleet", "--ledger", url], capture_output=True, text=True, timeout=120, env=env
    ).stdout
    assert f"bert-warmup ({job['job_id']})" in text


def test_a_run_directory_whose_name_is_not_utf8_is_accounted_and_shown_escaped(
    runs, tmp_path, capsys, monkeypatch
):
    """A directory name is bytes: one that is not UTF-8 (Python holds its bytes as surrogates) made `ettr
    fleet` exit with a UnicodeEncodeError traceback (the summary cache hashed the path's text), and then
    skipped the job (SQLite's read-only URI was the path's text): whoever could make a directory among the
    fleet's run directories stopped the whole fleet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the summary cache is on
    odd = runs / os.fsdecode(b"bad\xff\x1b[31mred")
    write_job(odd, JobSpec(job_id="odd", family="other", start_ts=T0 + 60))
    for _ in range(2):  # computed, then from the cache
        assert main(["fleet", *map(str, sorted(runs.iterdir())), "--json"]) == 0
        captured = capsys.readouterr()
        assert "odd" in {j["job_id"] for j in json.loads(captured.out)["jobs"]}, captured.err
        assert captured.err == ""
    assert main(["fleet", str(odd)]) == 0
    text = capsys.readouterr().out
    assert "odd" in text and "\x1b" not in text


def test_a_forged_family_or_a_run_directory_named_with_a_newline_adds_no_line_of_its_own(tmp_path, capsys):
    # A forged ledger's family (`ettr run --family` refuses one that is not one line) and a run directory
    # named with a newline (anyone may make one in a shared runs folder that `ettr fleet runs/*` reads) were
    # printed as they are: lines that read as ettr's own (`fleet: 9 jobs | ETT 99.9%`).
    fake = "fleet: 9 jobs | ETT 99.9% FAKE"
    write_job(tmp_path / "a", JobSpec(job_id="a1", family=f"train\n{fake}", start_ts=T0))
    write_job(tmp_path / f"b\n{fake}", JobSpec(job_id=_generated(1), family="train", start_ts=T0 + 10))
    assert main(["fleet", str(tmp_path / "a"), str(tmp_path / f"b\n{fake}")]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith(fake) for line in out.splitlines()), out
    assert main(["report", str(tmp_path / f"b\n{fake}"), str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith(fake) for line in out.splitlines()), out
    assert main(["fleet", str(tmp_path / "a"), "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["jobs"][0]["family"] != f"train\n{fake}"
    )  # not the family recorded
