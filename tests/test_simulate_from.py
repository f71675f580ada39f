"""`ettr simulate --from` on the runs a user has (issue 27): a short run with a failure, a run without one, a
one-process test job. Their measured rates are no rates to extrapolate, so the simulation assumes Llama 3's
failure rate and 8 GPUs per node unless told otherwise, and says so in one line; every `ettr simulate` line
of the README and docs/simulate.md runs as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.simulate.command import EPILOG, LLAMA3_FAILURES_PER_NODE_DAY

ROOT = Path(__file__).resolve().parent.parent
PLAIN = str(Path(__file__).parent / "scripts" / "train_plain.py")
ETTR = [sys.executable, "-m", "ettr.cli"]


def ettr(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run(
        [*ETTR, *args], capture_output=True, text=True, timeout=300, env=env, check=False, cwd=cwd
    )


def simulate_json(*args: str) -> dict[str, Any]:
    done = ettr("simulate", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def hand_built_run(run_dir: Path, *, crash: bool, world_size: int = 1) -> Path:
    """A 40-second job of 20 one-second steps (a save every 5), with or without one crash at step 12."""
    from ettr.ledger import open_ledger

    K = EventKind
    events = [Event(K.SUPERVISOR_START, 0.0, 0, SUPERVISOR_RANK)]
    t, attempt, step, resumed = 0.0, 0, 0, None
    while step < 20:
        events.append(Event(K.ATTEMPT_START, t, attempt, SUPERVISOR_RANK))
        for rank in range(world_size):
            events.append(Event(K.PROCESS_START, t, attempt, rank, data={"world_size": world_size}))
        if resumed is not None:
            events.append(Event(K.RESUMED, t + 2.0, attempt, 0, step=resumed))
        t += 2.0
        failed = False
        while step < 20:
            step, t = step + 1, t + 1.0
            events.append(Event(K.STEP, t, attempt, 0, step=step))
            if step % 5 == 0:
                events.append(Event(K.CHECKPOINT_COMMIT, t, attempt, 0, step=step))
            if crash and attempt == 0 and step == 12:
                failed = True
                break
        outcome = {"outcome": "failed", "exit_code": 1} if failed else {"outcome": "completed"}
        events.append(Event(K.ATTEMPT_END, t + 0.5, attempt, SUPERVISOR_RANK, data=outcome))
        t += 1.5
        if failed:
            attempt, step, resumed = attempt + 1, 10, 10
    events.append(Event(K.JOB_END, t, 0, SUPERVISOR_RANK, data={"exit_status": 0}))
    run_dir.mkdir(parents=True)
    ledger = open_ledger(run_dir)
    ledger.append(events)
    ledger.close()
    return run_dir


@pytest.mark.parametrize("crash", [True, False], ids=["one-failure", "no-failure"])
def test_a_short_run_projects_with_the_default_rate_and_8_gpus_per_node(tmp_path: Path, crash: bool) -> None:
    run_dir = hand_built_run(tmp_path / "run", crash=crash)
    args = ("simulate", "--from", str(run_dir), "--gpus", "2048", "--duration-hours", "336", "--compare")
    done = ettr(*args)
    assert done.returncode == 0, done.stderr
    assumed = [line for line in done.stdout.splitlines() if line.startswith("  assumed:")]
    assert len(assumed) == 1, done.stdout
    assert "Llama 3's failure rate" in assumed[0] and "8 GPUs per node" in assumed[0]
    assert "--failures-per-node-day" in assumed[0] and "--gpus-per-node" in assumed[0]
    assert "2048 GPUs (256 nodes)" in done.stdout
    assert "rates measured" not in done.stdout

    out = simulate_json("--from", str(run_dir), "--gpus", "2048", "--duration-hours", "336", "--runs", "50")
    assert out["assumed"]["failures_per_node_day"] == pytest.approx(LLAMA3_FAILURES_PER_NODE_DAY)
    assert out["assumed"]["gpus_per_node"] == 8
    # 256 nodes x 0.0042 a day x 14 days: about 15 failures, not billions and not none.
    assert out["num_failures_mean"] == pytest.approx(256 * LLAMA3_FAILURES_PER_NODE_DAY * 14, rel=0.3)
    assert out["ett_pct"] < 100.0
    assert out["profile"]["num_failed"] == (1 if crash else 0)


def test_given_rates_and_node_size_are_used_and_nothing_is_assumed(tmp_path: Path) -> None:
    run_dir = hand_built_run(tmp_path / "run", crash=True)
    base = ("--from", str(run_dir), "--gpus", "64", "--duration-hours", "24", "--runs", "20")
    rate_given = simulate_json(*base, "--failures-per-node-day", "0.5")
    assert "failures_per_node_day" not in rate_given["assumed"]
    assert rate_given["assumed"]["gpus_per_node"] == 8
    assert rate_given["num_failures_mean"] == pytest.approx(8 * 0.5, rel=0.6)
    both = simulate_json(*base, "--failures-per-node-day", "0.5", "--gpus-per-node", "4")
    assert "assumed" not in both
    text = ettr("simulate", *base, "--failures-per-node-day", "0.5", "--gpus-per-node", "4")
    assert text.returncode == 0 and "assumed" not in text.stdout and "rates measured" not in text.stdout


def test_a_replay_assumes_nothing(tmp_path: Path) -> None:
    out = simulate_json("--from", str(hand_built_run(tmp_path / "run", crash=True)), "--replay")
    assert "assumed" not in out and out["num_failures_mean"] == 1


def test_a_one_process_job_scales_in_nodes_of_8(tmp_path: Path) -> None:
    out = simulate_json("--from", str(hand_built_run(tmp_path / "run", crash=False)), "--gpus", "2048",
                        "--failures-per-node-day", "0.01", "--duration-hours", "24", "--runs", "20")  # fmt: skip
    assert out["profile"]["gpus"] == 1 and out["profile"]["gpus_per_node"] == 8
    assert out["num_failures_mean"] == pytest.approx(256 * 0.01, rel=0.6)  # 256 nodes, not 2,048


def test_the_bucket_columns_say_which_mean_they_are(tmp_path: Path) -> None:
    done = ettr("simulate", "--from", str(hand_built_run(tmp_path / "run", crash=True)), "--runs", "20")
    assert done.returncode == 0, done.stderr
    assert "mean s per run" in done.stdout and "mean % of wall" in done.stdout
    assert "each run's share of its own wall time" in done.stdout


def test_a_long_sweep_says_how_far_it_is(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from ettr.cli import main as cli_main
    from ettr.simulate import command

    monkeypatch.setattr(command._Progress, "QUIET_S", 0.0)
    monkeypatch.setattr(command._Progress, "EVERY_S", 0.0)
    assert cli_main(["simulate", "--sweep", "gpus", "--sweep-values", "8,64,512", "--runs", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["ettr simulate: 1 of 3 sizes done (0 s)", "ettr simulate: 2 of 3 sizes done (0 s)"]


def _documented_lines() -> list[str]:
    """Every `ettr simulate ...` command of the README, docs/simulate.md and the --help examples."""
    texts = [(ROOT / "README.md").read_text(), (ROOT / "docs" / "simulate.md").read_text(), EPILOG]
    lines = []
    for text in texts:
        for match in re.finditer(r"^\s*(ettr simulate [^\n`#]*)", text, re.MULTILINE):
            lines.append(match.group(1).strip())
    return sorted(set(lines))


def test_the_documented_lines_are_found() -> None:
    lines = _documented_lines()
    assert any("--from runs/<job-id> --gpus 2048 --duration-hours 336 --compare" in line for line in lines)
    assert len(lines) >= 7


@pytest.mark.slow
def test_every_documented_simulate_line_runs_as_written_on_a_real_run(tmp_path: Path) -> None:
    """A real short run (an unmodified script under `ettr run`, one injected crash), then each line with its
    run directory put in: status 0, an answer, nothing on stderr that is an error."""
    run_dir = tmp_path / "my-run"
    done = ettr("run", "--run-dir", str(run_dir), "--inject", "crash@step=13", "--", sys.executable, PLAIN,
                "--ckpt-dir", str(tmp_path / "ckpt"), "--num-steps", "30", "--save-every", "5",
                "--step-s", "0.02", "--init-s", "0.1", "--first-batch-s", "0.1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for line in _documented_lines():
        argv = re.sub(r"runs/(<job-id>|job1)", str(run_dir), line).split()[1:]
        done = ettr(*argv, cwd=tmp_path)
        assert done.returncode == 0, (line, done.stderr)
        assert done.stdout.strip() and "Traceback" not in done.stderr, line
        assert all(e.startswith("ettr simulate: ") for e in done.stderr.splitlines()), (line, done.stderr)
        if "--from" in argv and "--replay" not in argv:
            assert "assumed" in done.stdout, line  # a 10-second run's rate is never extrapolated


def test_an_interval_sweep_of_a_short_run_stays_within_its_training(tmp_path: Path, capsys: Any) -> None:
    """A profile read with `--from` gives the job as an amount of training, not a wall time: the sweep's
    intervals were bounded by the wall time only, and `--sweep interval` of any short run (20 s of
    training) ended in a ValueError traceback; `--sweep-values` past it was not refused in one line."""
    from ettr.cli import main as cli_main

    run_dir = hand_built_run(tmp_path / "run", crash=True)
    assert cli_main(["simulate", "--from", str(run_dir), "--sweep", "interval", "--runs", "2", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert points and all(p["interval_s"] <= 20.0 for p in points)
    argv = [
        "simulate",
        "--from",
        str(run_dir),
        "--sweep",
        "interval",
        "--sweep-values",
        "5,1000",
        "--runs",
        "2",
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "longer than the job" in err, err


def test_a_replay_refuses_the_flags_it_would_ignore(tmp_path: Path, capsys: Any) -> None:
    """A replay's interruptions are the run's own, at its own size: `--gpus 4096` was refused as "1.5e+06
    interruptions a day" (the short run's measured rate scaled up, which the replay never uses), and
    `--failures-per-node-day`, `--weibull-shape` or `--recovery` were silently ignored."""
    from ettr.cli import main as cli_main

    run_dir = str(hand_built_run(tmp_path / "run", crash=True))
    for extra in (["--gpus", "4096"], ["--failures-per-node-day", "3"], ["--weibull-shape", "0.7"],
                  ["--recovery", "in_place=2:0.5"], ["--preemptions-per-day", "1"]):  # fmt: skip
        assert cli_main(["simulate", "--from", run_dir, "--replay", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("ettr simulate: --replay replays") and extra[0] in err and "\n" not in err
    assert cli_main(["simulate", "--from", run_dir, "--replay", "--restart-s", "5", "--json"]) == 0
