"""The command line's outside: the contract's commands and flags, and one-line errors with status 2."""

from __future__ import annotations

import argparse
import json
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
    "report": {"--json", "--html", "--trace", "--tensorboard"},
    "interval": {"--blocking", "--failures-per-day", "--train-hours", "--json"},
    "demo": {"--quick", "--out"},
    "publish": {"--watch", "--poll-interval", "--lease-ttl", "--max-attempts", "--request", "--json"},
    "fleet": {"--ledger", "--since", "--check", "--preempt-order", "--need-gpus", "--json", "--html"},
    "serve": {"--ledger", "--port"},
}


# The whole command line, frozen: every subcommand and every flag and positional of each. A change here is a
# change of the outside (CONTRACT.md: add, never rename); update this table in the same commit, on purpose.
FROZEN_COMMAND_LINE = {
    "run": (
        {
            "--allocated-at",
            "--continue-job",
            "--family",
            "--grace",
            "--hang-phase-timeout",
            "--hang-step-factor",
            "--hang-timeout",
            "--inject",
            "--job-id",
            "--ledger",
            "--max-restarts",
            "--no-auto",
            "--peer-timeout",
            "--run-dir",
            "--submitted-at",
        },
        ["command"],
    ),
    "report": (
        {"--html", "--job-id", "--json", "--ledger", "--tensorboard", "--trace", "--window"},
        ["run_dirs"],
    ),
    "interval": ({"--blocking", "--failures-per-day", "--json", "--train-hours"}, []),
    "demo": ({"--out", "--quick", "--one-after-the-other"}, []),
    "publish": (
        {
            "--allow-factory",
            "--allow-pythonpath",
            "--allow-unsigned",
            "--json",
            "--lease-ttl",
            "--max-attempts",
            "--poll-interval",
            "--request",
            "--retry",
            "--root",
            "--watch",
        },
        ["queue_dir"],
    ),
    "compile-report": ({"--json"}, ["run_dir"]),
    "deliver": (set(), ["run_dirs"]),
    "simulate": (
        {
            "--async-blocking-s",
            "--cached-compile-s",
            "--checkpoint-blocking-s",
            "--compare",
            "--demand-gpus",
            "--demands-per-day",
            "--duration-hours",
            "--failures-per-node-day",
            "--fleet-experiment",
            "--fleet-jobs",
            "--from",
            "--gpus",
            "--gpus-per-node",
            "--html",
            "--interval",
            "--interval-s",
            "--json",
            "--mtbf-hours",
            "--recovery",
            "--no-save-on-preempt",
            "--persist-s",
            "--preemptions-per-day",
            "--publish-s",
            "--replay",
            "--restart-s",
            "--runs",
            "--seed",
            "--shutdown-s",
            "--startup-s",
            "--step-s",
            "--sweep",
            "--sweep-values",
            "--weibull-shape",
        },
        [],
    ),
    "fleet": (
        {
            "--cache-dir",
            "--check",
            "--from-events",
            "--html",
            "--json",
            "--ledger",
            "--need-gpus",
            "--no-cache",
            "--preempt-order",
            "--since",
            "--workers",
        },
        ["run_dirs"],
    ),
    "serve": (
        {
            "--addr",
            "--cache-dir",
            "--from-events",
            "--ledger",
            "--no-cache",
            "--port",
            "--window",
            "--workers",
        },
        ["run_dirs"],
    ),
}
_HELP = {"-h", "--help"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_contract_commands_and_flags_exist():
    subs = _subparsers(build_parser())
    for name, flags in CONTRACT_FLAGS.items():
        assert name in subs
        have = {opt for a in subs[name]._actions for opt in a.option_strings}
        assert flags <= have, f"ettr {name} lacks {flags - have}"


def test_a_command_is_parsed_by_its_own_flags_alone_without_the_others_modules():
    """`ettr run` builds its own flags only: the same as in the whole parser, and the fleet's and the
    simulator's modules (imported to build their flags) are not imported before its supervisor starts."""
    whole, alone = _subparsers(build_parser()), _subparsers(build_parser("run"))
    assert set(alone) == set(whole)
    assert [a.option_strings for a in alone["run"]._actions] == [
        a.option_strings for a in whole["run"]._actions
    ]
    assert [a.option_strings for a in alone["fleet"]._actions] == [["-h", "--help"]]
    code = (
        "import sys; from ettr.cli import build_parser; build_parser('run').parse_args(['run', '--', 'true']); "
        "print(sorted(m for m in ('ettr.fleet.command', 'ettr.simulate.command') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_whole_command_line_is_frozen_by_equality():
    parser = build_parser()
    assert {o for a in parser._actions for o in a.option_strings} == _HELP | {"--version"}
    subs = _subparsers(parser)
    assert set(subs) == set(FROZEN_COMMAND_LINE)
    for name, (flags, positionals) in FROZEN_COMMAND_LINE.items():
        actions = subs[name]._actions
        assert {o for a in actions for o in a.option_strings} == flags | _HELP, f"ettr {name}"
        assert [a.dest for a in actions if not a.option_strings] == positionals, f"ettr {name}"


def test_top_level_help_reads_cleanly():
    out = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "report ETT% and the wall-time breakdown" in " ".join(out.split())
    assert "{" not in out and "option_strings" not in out  # not a Python dict (an unescaped % once did that)


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
        ["run", "--hang-step-factor", "0", "--", "python", "x.py"],
        ["run", "--hang-step-factor", "1.5", "--", "python", "x.py"],  # would kill healthy steps
        ["run", "--hang-step-factor", "nan", "--", "python", "x.py"],
        ["run", "--hang-step-factor", "inf", "--", "python", "x.py"],
        ["run", "--hang-step-factor", "5", "--hang-timeout", "60", "--", "python", "x.py"],
        ["run", "--hang-phase-timeout", "-1", "--", "python", "x.py"],
        ["run", "--hang-phase-timeout", "0", "--", "python", "x.py"],
    ],
)
def test_bad_usage_is_one_line_and_status_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--bogus", "--", "python", "x.py"],
        ["report", "--bogus"],
        ["interval", "--blocking", "1", "--failures-per-day", "1", "--bogus"],
        ["simulate", "--bogus"],
        ["fleet", "--bogus"],
        ["publish", "q", "--bogus"],
    ],
)
def test_an_unknown_flag_names_its_command(argv, capsys):
    """The top parser used to say `ettr: unrecognized arguments: --bogus` for `ettr run --bogus`."""
    cmd = argv[0]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ettr {cmd}: ") and "--bogus" in err, err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "ettr.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "report" in out.stdout


def test_the_hang_bound_flags_set_the_watchdogs_bounds():
    from ettr.supervisor import config_from_args

    argv = ["run", "--hang-step-factor", "4", "--hang-phase-timeout", "900", "--", "python", "x.py"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.hang_step_multiple, config.default_hang_timeout_s) == (4.0, 900.0)
    default = config_from_args(build_parser().parse_args(["run", "--", "python", "x.py"]))
    assert (default.hang_step_multiple, default.default_hang_timeout_s) == (10.0, 300.0)


def test_grace_sets_how_long_a_preempted_job_may_save_before_sigkill(capsys):
    """A script that saves on SIGTERM (HF Trainer's enable_jit_checkpoint waits 3 s, then saves at its next
    step) had a fixed 10 s before SIGKILL, whatever the scheduler allows (Slurm's KillWait is 30 s)."""
    from ettr.supervisor import config_from_args

    config = config_from_args(build_parser().parse_args(["run", "--grace", "45", "--", "python", "x.py"]))
    assert config.grace_s == 45.0
    assert config_from_args(build_parser().parse_args(["run", "--", "python", "x.py"])).grace_s == 10.0
    for bad in ("0", "-1", "nan", "inf", "x"):
        assert main(["run", "--grace", bad, "--", "python", "x.py"]) == 2
        assert capsys.readouterr().err.startswith("ettr run: argument --grace:")


@pytest.mark.parametrize("bad", ["missing", "empty", "garbage"])
def test_report_compares_what_it_can_read_and_says_one_line_about_a_bad_run_dir(bad, tmp_path, capsys):
    from ettr.testing.fleet import JobSpec, write_job

    good = write_job(tmp_path / "good", JobSpec(job_id="good-job"))
    other = write_job(tmp_path / "other", JobSpec(job_id="other-job"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "ledger.db").write_text("not a database")
    bad_dir = str(tmp_path / bad)

    assert main(["report", str(good), bad_dir, str(other), "--json"]) == 2  # bad input: status 2
    out, err = capsys.readouterr()
    assert [r["job_id"] for r in json.loads(out)] == ["good-job", "other-job"]
    assert len(err.strip().splitlines()) == 1 and bad_dir in err and "skipped" in err
    assert main(["report", str(good), bad_dir]) == 2  # one left: still reported (text), still one line
    out, err = capsys.readouterr()
    assert "good-job" in out and len(err.strip().splitlines()) == 1
    assert main(["report", str(good), bad_dir, "--json"]) == 2  # several asked: still an array
    assert [r["job_id"] for r in json.loads(capsys.readouterr().out)] == ["good-job"]


def test_report_of_only_bad_run_dirs_is_status_2_and_one_line_naming_each(tmp_path, capsys):
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    out, err = capsys.readouterr()
    assert not out and "a: no such run directory" in err and "b: no such run directory" in err
    assert "none of the 2 run directories could be read" in err and len(err.strip().splitlines()) == 1
