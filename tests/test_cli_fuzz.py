"""Fuzz the command line (issue 12 item 8): random argv for every subcommand gives exit status 0, 1 or 2
and never a traceback. Commands that would run for minutes are kept short: `run` always names a program
that does not exist, `publish` never gets `--watch`, `demo` and `serve` are only given argv they must refuse,
and `simulate` ends with a small run count and duration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ettr.cli import _COMMANDS, build_parser
from ettr.cli import main as cli_main


def _flags(command: str) -> list[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = sub.choices[command]
    return sorted(
        o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    )


_VALUES = st.sampled_from(
    ["0", "-1", "1", "3.5", "nan", "inf", "-inf", "1e400", "9" * 400, "", " ", "x", "--", "-", "\x00", "é",
     "2026-13-45T99:99", "runs", "/dev/null", "/", "/nonexistent/dir", "a" * 5000, "kill@step=1", "crash@",
     "sqlite:///nonexistent/x.db", "torch.nn.*", "os:system"]
) | st.text(max_size=12)  # fmt: skip


def _argv(command: str, flags: list[str], tmp: Path):
    chosen = (
        st.lists(st.tuples(st.sampled_from(flags), _VALUES, st.booleans()), max_size=5)
        if flags
        else st.just([])
    )
    positional = st.lists(_VALUES | st.just(str(tmp)), max_size=3)

    def build(items, args):
        argv = [command]
        for flag, value, with_value in items:
            argv += [flag, value] if with_value else [flag]
        argv += args
        if command == "run":
            argv += ["--", "/nonexistent/ettr-fuzz-program"]
        if command == "publish":
            argv = [a for a in argv if a != "--watch"]
        if command in ("demo", "serve"):  # a demo runs for minutes, a server until stopped
            argv += ["--no-such-flag"]
        if command == "simulate":  # the last flag wins: keep each example to a small simulation
            argv += ["--runs", "2", "--duration-hours", "24"]
        return argv

    return st.builds(build, chosen, positional)


_CAN_RUN = sorted(_COMMANDS)


@pytest.mark.parametrize("command", _CAN_RUN)
def test_random_argv_never_gives_a_traceback(command, tmp_path, capsys):
    flags = _flags(command)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(argv=_argv(command, flags, tmp_path))
    def check(argv):
        try:
            status = cli_main(argv)
        except SystemExit as exc:  # --help, --version
            status = exc.code
        captured = capsys.readouterr()
        assert status in (0, 1, 2), (argv, status, captured.err[-2000:])
        assert "Traceback" not in captured.err, (argv, captured.err[-3000:])
        if status == 2:
            assert len(captured.err.strip().splitlines()) == 1, (argv, captured.err[-3000:])

    check()


@pytest.mark.parametrize("stdout", ["closed", "read-only"])
def test_a_closed_or_read_only_stdout_is_one_line_not_a_silent_success(tmp_path, stdout):
    import os
    import subprocess
    import sys

    def arrange() -> None:
        os.close(1)
        if stdout == "read-only":
            os.open(os.devnull, os.O_RDONLY)  # takes fd 1, as `1</dev/null` does

    argv = [
        sys.executable,
        "-m",
        "ettr.cli",
        "interval",
        "--blocking",
        "10",
        "--failures-per-day",
        "3",
        "--json",
    ]
    done = subprocess.run(argv, stderr=subprocess.PIPE, text=True, preexec_fn=arrange, timeout=60)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "standard output" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "blocking, failures",
    [("5e-324", "1e308"), ("1e308", "5e-324"), ("1e300", "1e300"), ("100000", "100")],
)
def test_extreme_interval_inputs_are_one_line_never_infinity(blocking, failures, capsys):
    assert cli_main(["interval", "--blocking", blocking, "--failures-per-day", failures, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err


_HUGE = "9" * 400
_SIMULATE_EDGES = [
    ["--gpus", _HUGE], ["--gpus", "100000001"], ["--gpus-per-node", _HUGE], ["--runs", "1000000000"],
    ["--runs", _HUGE], ["--seed", _HUGE, "--runs", "2"], ["--duration-hours", "1e300"],
    ["--duration-hours", "1e400"], ["--duration-hours", "87601"], ["--mtbf-hours", "1e-300"],
    ["--mtbf-hours", "0.0003"], ["--failures-per-node-day", "1e300"], ["--failures-per-node-day", "5e-324"],
    ["--failures-per-node-day", "1e6"], ["--preemptions-per-day", "5e-324"], ["--preemptions-per-day", "1e7"],
    ["--checkpoint-blocking-s", "1e300"], ["--restart-s", "1e300"], ["--step-s", "1e-300"],
    ["--interval-s", "1e-300", "--failures-per-node-day", "0"], ["--weibull-shape", "1e-300"],
    ["--weibull-shape", "0.01", "--gpus", "16384"], ["--weibull-shape", "1e300"],
    ["--failures-per-node-day", "1e-6", "--weibull-shape", "2"], ["--gpus", "-1"], ["--runs", "-1"],
    ["--restart-s", "nan"], ["--restart-s", "inf"], ["--restart-s", "-1"], ["--restart-s", ""],
    ["--gpus", ""], ["--sweep", "gpus", "--sweep-values", "1e30"], ["--sweep", "gpus", "--sweep-values", "80000000"],
    ["--sweep", "interval", "--sweep-values", ",".join(str(i) for i in range(1, 500))],
    ["--sweep", "interval", "--sweep-values", "1e-300"], ["--sweep", "interval", "--sweep-values", "nan"],
    ["--sweep", "interval", "--sweep-values", ""], ["--sweep", "gpus", "--runs", "10000"],
    ["--recovery", "in_place=1e400:0.5"], ["--recovery", "=:"], ["--recovery", "in_place=nan:nan"],
    ["--recovery", "in_place=-1:0.5"], ["--recovery", ""], ["--recovery", "in_place=1:" + _HUGE],
    ["--fleet-experiment", "--fleet-jobs", "1000000000"], ["--fleet-experiment", "--demands-per-day", "1e9"],
    ["--fleet-experiment", "--demands-per-day", "5e-324", "--runs", "2"],
    ["--fleet-experiment", "--duration-hours", "87600"], ["--fleet-experiment", "--runs", "10000"],
    ["--fleet-experiment", "--demand-gpus", _HUGE],
    ["--from", "/nonexistent/dir"], ["--from", "/"], ["--from", "/dev/null"], ["--from", ""],
    ["--replay"], ["--from", "/nonexistent", "--replay", "--sweep", "gpus"],
]  # fmt: skip


@pytest.mark.parametrize("argv", _SIMULATE_EDGES, ids=lambda a: " ".join(a)[:60])
def test_simulate_edges_are_bounded_and_one_line(argv, capsys):
    """Huge, tiny, non-finite and empty numbers, bad recovery specs and bad run directories: exit status 0
    (a bounded answer) or 2 with one line, never a traceback; each returns in seconds (a loop over an
    infinite gap, or billions of runs, used to hang here)."""
    status = cli_main(["simulate", *argv])
    captured = capsys.readouterr()
    assert status in (0, 2), (argv, status, captured.err[-2000:])
    assert "Traceback" not in captured.err
    if status == 2:
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err[-2000:]
    else:
        assert captured.out.strip() and not captured.err.strip(), captured.err[-2000:]


def _damaged_run(tmp: Path, sql: str | None = None, ledger_bytes: bytes | None = None) -> Path:
    """A real run directory's shape (a hand-built 20-step job with a crash), then damaged."""
    import sqlite3

    from test_simulate_from import hand_built_run

    run_dir = hand_built_run(tmp / "run", crash=True)
    if sql is not None:
        with sqlite3.connect(run_dir / "ledger.db") as db:
            db.executescript(sql)
    if ledger_bytes is not None:
        (run_dir / "ledger.db").write_bytes(ledger_bytes)
        for extra in ("ledger.db-wal", "ledger.db-shm"):
            (run_dir / extra).unlink(missing_ok=True)
    return run_dir


@pytest.mark.parametrize(
    "damage",
    [
        {"sql": "UPDATE events SET attempt=9223372036854775807 WHERE kind='step' AND step=20"},
        {"sql": "UPDATE events SET ts=1e308 WHERE kind='step' AND step=3"},
        {"sql": "UPDATE events SET data='" + "[" * 5000 + "]" * 5000 + "' WHERE kind='process_start'"},
        {"sql": 'UPDATE events SET data=\'{"world_size": ' + "9" * 30 + "}' WHERE kind='process_start'"},
        {"sql": "UPDATE events SET step=-5 WHERE kind='step'"},
        {"sql": "UPDATE events SET kind='bogus' WHERE kind='attempt_end'"},
        {"sql": "UPDATE events SET step=9223372036854775807 WHERE kind='step' AND step=20"},
        {"sql": "DELETE FROM events WHERE kind='step'"},
        {"sql": "UPDATE events SET value='nan', ts='x'"},
        {"sql": "DROP TABLE events"},
        {"ledger_bytes": b"\x00garbage" * 500},
        {"ledger_bytes": b""},
    ],
    ids=lambda d: next(iter(d.values()))[:40] if d else "",
)
@pytest.mark.parametrize(
    "mode", [[], ["--replay"], ["--gpus", "2048", "--duration-hours", "336", "--compare"]]
)
def test_simulate_from_a_damaged_run_is_an_answer_or_one_line(tmp_path, capsys, damage, mode):
    run_dir = _damaged_run(tmp_path, **damage)
    status = cli_main(["simulate", "--from", str(run_dir), "--runs", "20", *mode])
    captured = capsys.readouterr()
    assert status in (0, 2), (damage, status, captured.err[-2000:])
    assert "Traceback" not in captured.err
    if status == 2:
        assert len(captured.err.strip().splitlines()) == 1, captured.err[-2000:]
    else:
        assert "ETT" in captured.out


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--inject", "a" * 100_000, "--", "true"],
        ["run", "--family", "b" * 100_000, "--", "true"],
        ["run", "--job-id", "c" * 5_000, "--", "true"],
        ["run", "--ledger", "sqlite:///x%00y", "--", "true"],
        ["fleet", "--since", "d" * 50_000, "."],
    ],
)
def test_a_huge_or_nul_argument_is_one_short_line(argv, capsys):
    """One line that quotes a 100,000-character argument is no clear line: it keeps its start and the advice
    at its end. A NUL in a SQLite ledger path was a ValueError traceback (exit 1)."""
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 1100 and "Traceback" not in err[0], err
