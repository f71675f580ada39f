"""Process-level set-up of an instrumented training process (called from the bootstrap's sitecustomize).

Order matters: the recorder first (PROCESS_START at the process's real start time), then the heartbeat and
fault injection (both work with `--no-auto`), then the lazy torch hooks. Nothing here imports torch, and
nothing raises: a failure is logged and the script runs uninstrumented.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ettr.recorder import RecorderProtocol
    from ettr.run_env import RunEnv

logger = logging.getLogger("ettr")

_started: dict[str, Any] = {}


def is_training_process(environ: Mapping[str, str], pid: int) -> bool:
    """Whether this process is one the run should instrument.

    Under `ettr run` only: not a child of a process already instrumented (data loader or compile workers
    inherit its marker); for a torchrun command, only torchrun's workers (they carry TORCHELASTIC_RUN_ID),
    never the torchrun agent itself.
    """
    from ettr.run_env import RunEnv

    run_env = RunEnv.from_environ(environ)
    return run_env is not None and run_env.is_training_process(environ, pid)


def _install_excepthook(rec: RecorderProtocol) -> None:
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            if not issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
                rec.failure(exc)
                rec.flush(timeout_s=2.0)
                _started["uncaught"] = True
        except Exception:
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def start(environ: Mapping[str, str] | None = None) -> None:
    """Instrument this process if it is a training process of an `ettr run` (idempotent, never raises)."""
    environ = os.environ if environ is None else environ
    if _started or not is_training_process(environ, os.getpid()):
        return
    try:
        _start(environ)
    except Exception as exc:
        logger.warning(
            "ettr: bootstrap failed (%s: %s); the script runs uninstrumented", type(exc).__name__, exc
        )


def _start(environ: Mapping[str, str]) -> None:
    from ettr.run_env import INSTRUMENTED_ENV, Launcher, RunEnv, heartbeat_path
    from ettr.runtime import get_recorder

    run_env = RunEnv.from_environ(environ)
    if run_env is not None and run_env.launcher is Launcher.TORCHRUN:
        _mark_failed_exit_last(run_env)
    rec = get_recorder()  # records PROCESS_START
    _started["recorder"] = rec
    if not rec.enabled or run_env is None:
        return
    os.environ[INSTRUMENTED_ENV] = str(os.getpid())
    if run_env.launcher is Launcher.TORCHRUN:
        # A worker whose torchrun agent died (SIGKILLed with the supervisor) must not train on unrecorded.
        from ettr.procs import set_parent_death_signal

        set_parent_death_signal()
    _install_excepthook(rec)
    if rec.run_dir is not None:
        from ettr.heartbeat import MainThreadHeartbeat

        beat = MainThreadHeartbeat(heartbeat_path(rec.run_dir, rec.attempt, rec.rank))
        beat.start()
        _started["heartbeat"] = beat
    _start_injector(rec, run_env)
    _mark_first_step(rec, run_env)
    if run_env.auto:
        from ettr.bootstrap.hooks import AutoHooks
        from ettr.post_import import when_imported

        hooks = AutoHooks(rec)
        _started["hooks"] = hooks
        when_imported("torch", hooks.on_torch)
        when_imported("torch.distributed.checkpoint", hooks.on_dcp)
        when_imported("safetensors.torch", hooks.on_safetensors)
        _watch_frameworks(hooks)


MAX_WARM_MODULES = 64
"""The most installed packages a `trained_path` file names for the next attempt's standby."""


def installed_packages(modules: Mapping[str, Any] | None = None) -> list[str]:
    """Top-level packages imported so far that were installed (their file under a site-packages
    directory: never the script's own modules, never a PYTHONPATH checkout), ettr and torch aside (a
    standby imports those anyway), sorted, at most `MAX_WARM_MODULES`."""
    import site

    roots = tuple(os.path.join(p, "") for p in (*site.getsitepackages(), site.getusersitepackages()))
    found = []
    for name, module in list((sys.modules if modules is None else modules).items()):
        if "." in name or name.startswith("_") or name in ("ettr", "torch", "__main__"):
            continue
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(roots):
            found.append(name)
    return sorted(found)[:MAX_WARM_MODULES]


def _mark_first_step(rec: RecorderProtocol, run_env: RunEnv) -> None:
    """At this process's first step, write `trained_path`: the supervisor then knows that the start-up is
    over and starts the next attempt's standbys (`ettr.supervisor.standby`), which import ahead the
    installed packages the file names (`installed_packages`). One file, once."""
    from ettr.run_env import trained_path

    path = trained_path(run_env.run_dir, run_env.attempt, os.getpid())
    done = False

    def on_step(step: int) -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            import json

            from ettr.atomic import create_exclusive

            path.parent.mkdir(parents=True, exist_ok=True)
            # a hint, not a record: not fsync'd on the training thread
            create_exclusive(path, json.dumps({"modules": installed_packages()}), durable=False)
        except Exception:
            pass  # there already, or no place for it: the supervisor then waits for its fallback delay

    rec.add_step_listener(on_step)


def _mark_failed_exit_last(run_env: RunEnv) -> None:
    """After every other exit handler (atexit runs the first registered last; this is registered before
    the recorder's and the script's), a process that ends on an uncaught exception writes
    `failed_exit_path`: only the interpreter's teardown is left, which ettr's agent need not wait for;
    any other exit writes `exited_path` (its teardown is not a hang)."""
    import atexit

    def mark() -> None:
        try:
            from ettr.atomic import create_exclusive
            from ettr.run_env import exited_path, failed_exit_path

            where = failed_exit_path if _started.get("uncaught") else exited_path
            path = where(run_env.run_dir, run_env.attempt, os.getpid())
            path.parent.mkdir(parents=True, exist_ok=True)
            create_exclusive(path, b"")
        except Exception:
            pass

    atexit.register(mark)


def _watch_frameworks(hooks: Any) -> None:
    from ettr.bootstrap.frameworks import TRAINER_MODULES, FrameworkHooks
    from ettr.post_import import when_imported

    frameworks = FrameworkHooks(hooks.rec, guard=hooks.guard, patcher=hooks.patcher)
    for name in TRAINER_MODULES:
        when_imported(name, frameworks.on_import)


def _start_injector(rec: RecorderProtocol, run_env: RunEnv) -> None:
    from ettr import inject

    specs = inject.decode_specs(run_env.inject)
    if not specs:
        return
    injector = inject.Injector(specs, rec, attempt_started_at=run_env.attempt_started_at)
    if injector.specs:
        inject.install(injector)
        injector.start()
        _started["injector"] = injector
