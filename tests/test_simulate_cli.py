"""`ettr simulate` through `python -m ettr.cli`: the contract's JSON keys, sweeps, the policy comparison,
the fleet experiment, the HTML page, and one line with exit status 2 for bad parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ETTR = [sys.executable, "-m", "ettr.cli", "simulate"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    return subprocess.run([*ETTR, *args], capture_output=True, text=True, timeout=240, env=env, check=False)


def run_json(*args: str) -> dict[str, Any]:
    done = run(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_json_has_the_contract_keys_and_auto_is_the_optimum() -> None:
    out = run_json("--failures-per-node-day", "3", "--checkpoint-blocking-s", "15", "--interval", "auto",
                   "--duration-hours", "720", "--runs", "40")  # fmt: skip
    for key in ("ett_pct", "ett_pct_ci95", "interval_s", "buckets_pct", "num_failures_mean"):
        assert key in out
    lo, hi = out["ett_pct_ci95"]
    assert lo <= out["ett_pct"] <= hi
    assert out["interval_s"] == pytest.approx(15.5 * 60, rel=0.02)
    assert sum(out["buckets_pct"].values()) == pytest.approx(100.0)
    assert 100 - out["ett_pct"] == pytest.approx(3.23, abs=0.15)
    assert out["num_failures_mean"] == pytest.approx(90, rel=0.1)


def test_mtbf_and_restart_give_dalys_interval() -> None:
    out = run_json("--mtbf-hours", "24", "--checkpoint-blocking-s", "300", "--restart-s", "600",
                   "--interval", "auto", "--runs", "5")  # fmt: skip
    assert out["interval_s"] / 60 == pytest.approx(117, rel=0.015)


def test_what_restart_in_place_is_worth_at_ten_thousand_gpus() -> None:
    """The same seeded failures with 80% of them restarted in place at 2 s instead of a 600 s restart: the
    restart bucket shrinks to about the fifth that is left, and ETT gains what it lost."""
    base = ("--gpus", "10000", "--duration-hours", "720", "--restart-s", "600", "--checkpoint-blocking-s", "30",
            "--runs", "64")  # fmt: skip
    plain = run_json(*base)
    in_place = run_json(*base, "--recovery", "in_place=2:0.8")
    assert in_place["num_failures_mean"] == pytest.approx(plain["num_failures_mean"], rel=0.02)
    assert in_place["buckets_pct"]["restart"] == pytest.approx(
        plain["buckets_pct"]["restart"] * 0.2, rel=0.25
    )
    assert in_place["ett_pct"] > plain["ett_pct"] + 2
    assert in_place["recovery_kinds"] == [{"kind": "in_place", "cost_s": 2.0, "share": 0.8}]
    assert in_place["mean_restart_s"] == pytest.approx(0.8 * 2 + 0.2 * 600)


def test_sweep_interval_prints_points_and_the_best() -> None:
    out = run_json("--failures-per-node-day", "3", "--checkpoint-blocking-s", "15", "--duration-hours", "240",
                   "--sweep", "interval", "--sweep-values", "300,600,930,1500,3000", "--runs", "40")  # fmt: skip
    assert [p["interval_s"] for p in out["points"]] == [300, 600, 930, 1500, 3000]
    assert out["best"]["interval_s"] == 930
    assert out["optimum_interval_s"] == pytest.approx(15.5 * 60, rel=0.02)
    text = run("--failures-per-node-day", "3", "--checkpoint-blocking-s", "15", "--sweep", "interval",
               "--runs", "10")  # fmt: skip
    assert text.returncode == 0 and "<- best" in text.stdout and "model optimum" in text.stdout


def test_sweep_gpus_keeps_the_per_node_rate() -> None:
    out = run_json("--sweep", "gpus", "--sweep-values", "8,1024,16384", "--restart-s", "600", "--runs", "10")
    fails = [p["num_failures_mean"] for p in out["points"]]
    assert fails[0] < fails[1] < fails[2]
    assert out["points"][0]["ett_pct"] > out["points"][2]["ett_pct"]
    assert out["best"]["gpus"] == 8


def test_compare_policies_side_by_side(tmp_path: Path) -> None:
    page = tmp_path / "sim.html"
    out = run_json("--mtbf-hours", "6", "--checkpoint-blocking-s", "120", "--interval-s", "7200",
                   "--async-blocking-s", "5", "--publish-s", "600", "--runs", "20", "--compare",
                   "--html", str(page))  # fmt: skip
    rows = {r["policy"]: r for r in out["policies"]}
    assert rows["async saves"]["ett_pct"] > rows["sync saves"]["ett_pct"]
    assert rows["standalone publishing"]["ett_pct"] > rows["publish in the job"]["ett_pct"]
    assert rows["interval auto"]["ett_pct"] > rows["as given"]["ett_pct"]
    assert any("compile store" in line for line in out["not_compared"])
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "async saves" in html
    assert 'src="http' not in html and "<link" not in html  # self-contained


def test_fleet_experiment_lowest_cost_loses_less() -> None:
    out = run_json("--fleet-experiment", "--runs", "10", "--duration-hours", "72")
    random, cheapest = out["policies"]["random"], out["policies"]["lowest_cost"]
    assert cheapest["lost_gpu_hours"] < random["lost_gpu_hours"]
    assert cheapest["ett_pct"] > random["ett_pct"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpus", "0"], "--gpus must be between 1 and"),
        (["--restart-s", "-5"], "--restart-s must be a finite number >= 0"),
        (["--checkpoint-blocking-s", "nan"], "--checkpoint-blocking-s must be a finite number"),
        (["--mtbf-hours", "0"], "--mtbf-hours must be > 0"),
        (["--interval-s", "7200", "--duration-hours", "1"], "longer than the job"),
        (["--replay"], "--replay needs --from"),
        (["--from", "/nonexistent/run"], "no such run directory"),
        (["--runs", "0"], "--runs must be between 1 and"),
        (["--sweep", "interval", "--sweep-values", "60,abc"], "--sweep-values"),
        (["--checkpoint-blocking-s", "0", "--interval", "auto"], "needs a save cost"),
        (["--gpus", "many"], "not a whole number"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--weibull-shape", "0.7", "--gpus", "80000000"], "drawn per node"),
        (["--mtbf-hours", "0.001", "--runs", "1000", "--duration-hours", "720"], "simulated interruptions"),
        (["--recovery", "teleport=1:0.5"], "recovery kind must be one of"),
        (["--recovery", "in_place=fast:0.5"], "KIND=SECONDS:SHARE"),
        (["--recovery", "in_place=1:1.5"], "share must be between 0 and 1"),
        (["--recovery", "in_place=1:0.7", "--recovery", "requeue=9:0.6"], "add up to more than 1"),
    ],
)
def test_bad_parameters_are_one_line_and_status_2(args: list[str], words: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr


CONTRACT_FLAGS = (
    "--from", "--replay", "--gpus", "--gpus-per-node", "--failures-per-node-day", "--mtbf-hours",
    "--restart-s", "--checkpoint-blocking-s", "--interval-s", "--interval", "--duration-hours", "--step-s",
    "--runs", "--seed", "--sweep", "--json", "--html",
)  # fmt: skip


def test_help_lists_the_contract_flags_and_examples() -> None:
    done = run("--help")
    assert done.returncode == 0
    for flag in CONTRACT_FLAGS:
        assert f"{flag} " in done.stdout or f"{flag}\n" in done.stdout, flag
    assert "examples:" in done.stdout and "--replay" in done.stdout


def test_from_a_run_directory_replay_and_what_if(tmp_path: Path) -> None:
    from ettr.ledger import open_ledger
    from test_simulate_profile import make_job

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = open_ledger(run_dir)
    ledger.append(make_job())
    ledger.close()
    out = run_json("--from", str(run_dir), "--replay")
    assert out["replay"] is True and out["num_failures_mean"] == 1
    assert out["ett_pct"] == pytest.approx(out["measured"]["ett_pct"])
    assert out["profile"]["interval_steps"] == 4 and out["profile"]["step_s"] == pytest.approx(1.0)
    # What-if: the same job on 64 GPUs for a day at a real failure rate, every flag over the profile.
    what_if = run_json("--from", str(run_dir), "--gpus", "64", "--gpus-per-node", "4", "--failures-per-node-day",
                       "0.5", "--preemptions-per-day", "0", "--duration-hours", "24", "--runs", "20")  # fmt: skip
    assert what_if["gpus"] == 64 and what_if["interval_s"] == pytest.approx(4.0)
    assert what_if["num_failures_mean"] == pytest.approx(8.0, rel=0.5)  # 16 nodes x 0.5/day
