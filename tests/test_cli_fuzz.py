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
