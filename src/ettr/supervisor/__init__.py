"""`ettr run`: launch a training command, restart it after failures, and keep its books.

    from ettr.supervisor import RunConfig, run
    status = run(RunConfig(command=("python", "train.py"), max_restarts=3))

Modules: `config` (RunConfig), `supervise` (the parts put together, the loop over attempts), `books`
(JobBooks: the only way to the ledger), `attempt` (the Attempt and AttemptKind Protocols, the plain
command), `workers` + `agent` (ettr as torchrun's agent), `runner` (one attempt, driving the pure `watch`),
`policy` (the pure restart policy), `peers` + `multinode` (the other nodes), `signals`, `launch` (command
line, torchrun's fresh rendezvous, the attempt's `RunEnv`), `process` (process tree, stderr tail),
`watchdog` (hangs, from the ledger and `ettr.heartbeat`), `classify` (why an attempt ended), `containment`,
`standby`, `restart`, `slurm`, `jobinfo` (job id, Slurm times), `messages`. Training processes import
nothing from here: what they share with the supervisor is `ettr.run_env`, `ettr.procs` and
`ettr.heartbeat`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ettr.supervisor.config import RunConfig
    from ettr.supervisor.supervise import JobEndHook

__all__ = ["RunConfig", "config_from_args", "main", "run"]


def __getattr__(name: str) -> Any:
    if name == "RunConfig":
        from ettr.supervisor.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'ettr.supervisor' has no attribute {name!r}")


def run(config: RunConfig, *, at_job_end: JobEndHook | None = None) -> int:
    """Supervise `config.command` per the contract; the exit status (0, 1 or 143). Raises `UsageError`.
    `at_job_end` runs once the books are closed (`ettr.cli` stores the job's fleet summary so)."""
    from ettr.supervisor.supervise import run as _run

    return _run(config, at_job_end=at_job_end)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of parsed `ettr run` flags (see `ettr.cli`). Raises `UsageError` for bad values."""
    from ettr.errors import UsageError
    from ettr.inject import parse_specs
    from ettr.supervisor.config import RunConfig

    if args.run_dir is not None:
        _check_run_dir(args.run_dir)
    try:
        return RunConfig(
            command=tuple(args.command),
            run_dir=args.run_dir,
            job_id=args.job_id,
            max_restarts=args.max_restarts,
            inject=parse_specs(args.inject or ()),
            hang_timeout_s=args.hang_timeout,
            submitted_at=args.submitted_at,
            allocated_at=args.allocated_at,
            family=getattr(args, "family", None),
            auto=not args.no_auto,
            ledger_url=args.ledger,
            continue_job=bool(getattr(args, "continue_job", False)),
            **({"peer_timeout_s": args.peer_timeout} if getattr(args, "peer_timeout", None) else {}),
            **({"grace_s": args.grace} if getattr(args, "grace", None) else {}),
            **_hang_bounds(args),
        )
    except ValueError as exc:
        raise UsageError(f"ettr run: {exc}") from None


def _hang_bounds(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields of the hang-bound flags given (`--hang-step-factor`, `--hang-phase-timeout`)."""
    from ettr.errors import UsageError

    factor = getattr(args, "hang_step_factor", None)
    phase_s = getattr(args, "hang_phase_timeout", None)
    if factor is not None and args.hang_timeout is not None:
        raise UsageError(
            "ettr run: --hang-step-factor and --hang-timeout do not go together (--hang-timeout replaces the "
            "bound of K step times; give one)"
        )
    bounds: dict[str, Any] = {}
    if factor is not None:
        bounds["hang_step_multiple"] = factor
    if phase_s is not None:
        bounds["default_hang_timeout_s"] = phase_s
    return bounds


def _check_run_dir(run_dir: str) -> None:
    """Refuse a `--run-dir` that cannot be one before anything starts: a file, or a directory this user
    cannot write (`UsageError`); a path that does not exist yet is made when the books open."""
    import os

    from ettr.errors import UsageError

    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError(f"ettr run: --run-dir {run_dir}: not a directory (give a directory, or a new path)")
    if os.path.isdir(run_dir) and not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"ettr run: --run-dir {run_dir}: not writable by this user (give another directory)")


def main(args: argparse.Namespace, *, at_job_end: JobEndHook | None = None) -> int:
    """`ettr run` with parsed flags (called by `ettr.cli`, which hands in the fleet's summary store)."""
    return run(config_from_args(args), at_job_end=at_job_end)
