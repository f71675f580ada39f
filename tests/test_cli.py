"""The command line's outside: the contract's commands and flags, and one-line errors with status 2."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ettr.cli import build_parser, main, parse_time

CONTRACT_FLAGS = {
    "run": {
        "--run-dir",
        "--job-id",
        "--max-restarts",
        "--inject",
        "--hang-timeout",
        "--submitted-at",
        "--allocated-at",
        "--no-auto",
        "--family",
    },
    "report": {"--json", "--html"},
    "interval": {"--blocking", "--failures-per-day", "--train-hours", "--json"},
    "demo": {"--quick", "--out"},
    "publish": {"--watch", "--poll-interval", "--lease-ttl", "--max-attempts", "--request", "--json"},
    "fleet": {"--ledger", "--since", "--check", "--preempt-order", "--need-gpus", "--json", "--html"},
    "serve": {"--ledger", "--port"},
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_contract_commands_and_flags_exist():
    subs = _subparsers(build_parser())
    for name, flags in CONTRACT_FLAGS.items():
        assert name in subs
        have = {opt for a in subs[name]._actions for opt in a.option_strings}
        assert flags <= have, f"ettr {name} lacks {flags - have}"


def test_time_accepts_unix_seconds_and_iso():
    assert parse_time("1700000000") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000.0
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("yesterday")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["run", "--max-restarts", "-1", "--", "python", "x.py"],
        ["run", "--submitted-at", "yesterday", "--", "python", "x.py"],
        ["run"],
        ["report"],
        ["report", "/definitely/not/here"],
    ],
)
def test_bad_usage_is_one_line_and_status_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "ettr.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "report" in out.stdout
