"""Process-level set-up of an instrumented training process (called from the bootstrap's sitecustomize).

Order matters: the recorder first (PROCESS_START at the process's real start time), then the heartbeat and
fault injection (both work with `--no-auto`), then the lazy torch hooks. Nothing here imports torch, and
nothing raises: a failure is logged and the script runs uninstrumented.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
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


def _install_excepthook() -> None:
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
            record_uncaught(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def record_uncaught(exc: BaseException) -> None:
    """This instrumented process is ending on `exc`: its FAILURE, written now (the excepthook; a rank that
    `torch.multiprocessing.spawn` started, whose exception torch's wrapper catches first). Never raises."""
    rec = _started.get("recorder")
    if rec is None:
        return
    try:
        rec.failure(exc, launcher=_is_launcher_now())
        rec.flush(timeout_s=2.0)
        _started["uncaught"] = True
    except Exception:
        pass


def start(environ: MutableMapping[str, str] | None = None, *, argv: Sequence[str] | None = None) -> None:
    """Instrument this process if it is a training process of an `ettr run` (idempotent, never raises);
    a torchrun launcher started inside the job (`argv`, default `sys.orig_argv`) is never instrumented: its
    workers are (`hand_ranks_to_workers`)."""
    environ = os.environ if environ is None else environ
    if _started:
        return
    from ettr.warn import mark_line_starts

    mark_line_starts()  # any process of the job's side: a launcher's lines too start on a line of their own
    from ettr.run_env import RUN_DIR_ENV, runs_rank_launcher, runs_torchrun

    argv = getattr(sys, "orig_argv", []) if argv is None else argv
    torchrun = runs_torchrun(argv)
    if environ.get(RUN_DIR_ENV) and (torchrun or runs_rank_launcher(argv)):
        _started["launcher"] = True
        if torchrun:
            _warn_nodes_unseen(environ, argv)
        try:
            hand_ranks_to_workers(environ, os.getpid(), torchrun=torchrun)
        except Exception as exc:
            logger.warning(
                "ettr: could not hand the ranks to the launcher's workers (%s: %s)", type(exc).__name__, exc
            )
        _note_launcher_signals(environ)
        return
    if not is_training_process(environ, os.getpid()):
        return
    from ettr.run_env import SPARE_ENV

    if environ.get(SPARE_ENV):
        _hold(environ)  # a spare: nothing is recorded until it is promoted (`promote_spare`)
        return
    try:
        _start(environ)
    except Exception as exc:
        logger.warning(
            "ettr: bootstrap failed (%s: %s); the script runs uninstrumented", type(exc).__name__, exc
        )


def _note_launcher_signals(environ: Mapping[str, str]) -> None:
    """A launcher's own signal handlers (torch elastic's agent, in torchrun or `accelerate launch`, turns a
    SIGTERM into `SignalException`, stops its workers and exits) note when a signal reached it, as a
    training process's do (`ettr.bootstrap.outside_signals`): a SIGTERM sent to the launcher from outside
    (`exec torchrun` behind a wrapper, an operator's `kill`) then has an onset, the accounting's failure
    instant, and the seconds its workers took to stop are the restart's, not lost progress (never raises)."""
    from ettr.run_env import LAUNCHER_SIGNAL_RANK, RunEnv

    try:
        run_env = RunEnv.from_environ(environ)
        if run_env is not None:
            from ettr.bootstrap.outside_signals import install as note_outside_signals

            note_outside_signals(str(run_env.run_dir), run_env.attempt, LAUNCHER_SIGNAL_RANK)
    except Exception:
        pass


def _warn_nodes_unseen(environ: Mapping[str, str], argv: Sequence[str]) -> None:
    """A torchrun of several nodes that the job's command started (a node script, `srun bash train.sh`), not
    `ettr run` itself: each node's supervisor sees only its own node's ranks, so say so once (never raises)."""
    from ettr.run_env import LAUNCHER_ENV, Launcher, torchrun_nodes

    try:
        nodes = torchrun_nodes(argv)
        if nodes is None or nodes <= 1 or environ.get(LAUNCHER_ENV) == Launcher.TORCHRUN.value:
            return  # one node, or the supervisor's own command (a node's supervisor: docs/multinode.md)
        logger.warning(
            "ettr: this torchrun runs %d nodes (--nnodes) but was started by the job's command, not by `ettr "
            "run`: this node's books hold only this node's ranks (their steps, saves and failures); for one "
            "job's books run `ettr run --ledger URL --job-id ID -- torchrun --nnodes ...` on every node "
            "(docs/multinode.md)",
            nodes,
        )
    except Exception:
        pass


def at_first_step(action: Callable[[], None]) -> None:
    """Run `action` at this process's first step, beside the `trained_path` marker (the training thread;
    an action that raises is skipped)."""
    _started.setdefault("first_step", []).append(action)


def tell_launcher(pid: int, what: bytes, run_env: RunEnv | None = None) -> None:
    """Tell process `pid` of this attempt (`run_env`, default this process's) that it is a launcher, not a
    rank (`launcher_parent_path`, which its heartbeat and injector look at): it fires no fault and stops
    beating. Once; never raises."""
    from ettr.atomic import create_exclusive
    from ettr.run_env import RunEnv, launcher_parent_path
    from ettr.untrusted import make_dirs_below

    try:
        run_env = run_env or RunEnv.from_environ(os.environ)
        if run_env is None:
            return
        path = launcher_parent_path(run_env.run_dir, run_env.attempt, pid)
        make_dirs_below(run_env.run_dir, path.parent)  # never through a symlinked agent/
        create_exclusive(path, what, durable=False)  # a hint for a live process: not fsync'd
    except FileExistsError:
        pass  # told already (another rank, a second torchrun of that program)
    except Exception as exc:
        logger.warning(
            "ettr: could not tell process %d it is a launcher (%s: %s)", pid, type(exc).__name__, exc
        )


def hand_ranks_to_workers(environ: MutableMapping[str, str], pid: int, *, torchrun: bool = True) -> None:
    """In a torchrun launcher (`pid`) that something inside the job started -- a shell script, a Makefile,
    a Python program -- make its workers the training ranks: `ETTR_LAUNCHER=torchrun` (the bootstrap then
    instruments the processes that carry TORCHELASTIC_RUN_ID, each with its own RANK) and no instrumented
    marker inherited from a Python program above it (which would leave the workers alone as that
    program's children). That program, instrumented as the first Python process of the attempt, is told
    that it is a launcher too (`launcher_parent_path`): it fires no fault and stops beating.

    `torchrun=False`: `accelerate launch`, which runs the script as one process of its own (CPU, one device)
    or through torch elastic's agent in its own process, and DeepSpeed's launchers (`deepspeed train.py`:
    its runner starts `python -m deepspeed.launcher.launch`, which starts the ranks with their `RANK`): the
    launcher is left alone like a shell wrapper, its children are the attempt's first Python processes."""
    from ettr.run_env import INSTRUMENTED_ENV, LAUNCHER_ENV, RANK_CLEARS, Launcher, RunEnv

    run_env = RunEnv.from_environ(environ)
    for name in (INSTRUMENTED_ENV, *RANK_CLEARS):
        environ.pop(name, None)
    if torchrun:
        environ[LAUNCHER_ENV] = Launcher.TORCHRUN.value
    parent = None if run_env is None else run_env.instrumented_pid
    if parent is not None and parent != pid:  # else none above it, or it exec'd into torchrun
        tell_launcher(parent, str(pid).encode(), run_env)


def _start(environ: Mapping[str, str]) -> None:
    from ettr.run_env import (
        INSTRUMENTED_ENV,
        INSTRUMENTED_WORLD_ENV,
        Launcher,
        RankEnv,
        RunEnv,
        heartbeat_path,
    )
    from ettr.runtime import get_recorder

    run_env = RunEnv.from_environ(environ)
    if run_env is not None and run_env.launcher is Launcher.TORCHRUN and not _started.get("exit_marked"):
        _mark_failed_exit_last(run_env)
    rec = get_recorder()  # records PROCESS_START
    _started["recorder"] = rec
    _started["run_env"] = run_env
    if not rec.enabled or run_env is None:
        return
    os.environ[INSTRUMENTED_ENV] = str(os.getpid())
    os.environ[INSTRUMENTED_WORLD_ENV] = str(RankEnv.from_environ(os.environ).world_size)
    if run_env.launcher is Launcher.TORCHRUN:
        # A worker whose torchrun agent died (SIGKILLed with the supervisor) must not train on unrecorded.
        from ettr.procs import set_parent_death_signal

        set_parent_death_signal()
    _install_excepthook()
    if rec.run_dir is not None:
        from ettr.bootstrap.outside_signals import install as note_outside_signals

        note_outside_signals(str(rec.run_dir), rec.attempt, rec.rank)
    launches = _launches_torchrun(run_env)
    if rec.run_dir is not None:
        from ettr.heartbeat import MainThreadHeartbeat, Progress

        progress = Progress()  # the pulse: how this process moves, for hang bounds that follow the job
        rec.add_listener(progress.observe)
        _started["progress"] = progress
        from ettr.bootstrap.long_calls import watch_long_calls
        from ettr.post_import import when_imported

        watch_long_calls(progress, when_imported)  # a long save, load or data wait is its phase, not a hang
        path = heartbeat_path(rec.run_dir, rec.attempt, rec.rank)
        beat = MainThreadHeartbeat(path, stands_down=launches, progress=progress, run_dir=rec.run_dir)
        beat.start()
        _started["heartbeat"] = beat
        _keep_step_tail(rec)  # a launcher takes no steps: it writes none
    _start_injector(rec, run_env, stands_down=launches)
    _mark_first_step(rec, run_env)
    if (
        launches is not None
    ):  # ranks it may spawn or fork itself (`torch.multiprocessing.spawn`) are the ranks
        from ettr.bootstrap.spawned import install, watch_forks

        install(str(run_env.run_dir), run_env.attempt)
        watch_forks(str(run_env.run_dir), run_env.attempt)
        from ettr.bootstrap.unrecorded import record_at_exit

        record_at_exit(rec, str(run_env.run_dir), run_env.attempt)  # its children that train unrecorded
    if run_env.auto:
        from ettr.bootstrap.hooks import AutoHooks
        from ettr.post_import import when_imported

        hooks = AutoHooks(rec)
        _started["hooks"] = hooks
        when_imported("torch", hooks.on_torch)
        when_imported("torch.distributed.checkpoint", hooks.on_dcp)
        when_imported("safetensors.torch", hooks.on_safetensors)
        _watch_frameworks(hooks)


TORCH_PARTS = ("torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch._inductor.compile_fx")
"""Parts of torch that take seconds to import beyond `import torch`: a trained attempt's marker names those
it had imported (building DistributedDataParallel imports torch._dynamo; the first `torch.compile` imports
inductor's compile path, `torch._inductor.compile_fx`: ~1.5 s of CPU here, its lowering and kernel
templates), so that its standbys import them ahead only when a cold start would import them too."""
VEC_ISA_PROBE = "torch._inductor.cpu_vec_isa"
"""Named by a trained attempt's marker when its inductor probed the CPU's vector ISA
(`torch_compat.inductor_probed_vec_isa`): its standbys then run the probe ahead too
(`ettr.bootstrap.standby`), ~1.2 s of CPU that a replacement's first compile would wait for."""
MAX_WARM_MODULES = 64
"""The most installed packages a `trained_path` file names for the next attempt's standby."""
MAX_WARM_PARTS = 256
"""The most packages of torch and ettr a `trained_path` file names (`imported_parts`)."""


def imported_parts(modules: Mapping[str, Any] | None = None) -> list[str]:
    """The public packages of torch and of ettr imported so far (`torch.distributed.optim`,
    `torch.distributed.checkpoint`, `ettr.checkpoint`, `ettr.inplace`: none of them imported by `import
    torch` or by ettr's bootstrap, together up to a second of a replacement's start-up), and the
    `TORCH_PARTS` imported, sorted, at most `MAX_WARM_PARTS`. A standby imports them ahead, so that a
    replacement started from it (a killed rank's, restarted in place) has only the script's own work left;
    only what this attempt imported, so the standby imports nothing a cold start would not. Private
    packages (a part starting with `_`) other than `TORCH_PARTS` are left to the attempt: some read their
    process's state at import. (`torch._inductor.compile_fx` imports inductor's codecache, which fixes its
    precompiled-header directory from TMPDIR: the standby's TMPDIR is the attempt's, as a standby takes only
    an attempt of its own environment; a script that moves TMPDIR itself before it compiles has them moved
    with it at its first `torch.compile`, as a cold start's import would have put them: the compile session's
    `_header_dir_as_a_cold_start`.) `VEC_ISA_PROBE` is named when inductor probed the CPU's
    vector ISA: the standby runs that probe too."""
    found = [
        name
        for name, module in list((sys.modules if modules is None else modules).items())
        if name.partition(".")[0] in ("torch", "ettr")
        and "." in name
        and (
            name in TORCH_PARTS
            or (
                not any(part.startswith("_") for part in name.split("."))
                and getattr(module, "__path__", None) is not None
            )
        )
    ]
    from ettr.torch_compat import inductor_probed_vec_isa

    if inductor_probed_vec_isa(modules):
        found.append(VEC_ISA_PROBE)
    return sorted(found)[:MAX_WARM_PARTS]


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


def _keep_step_tail(rec: RecorderProtocol) -> None:
    """Note every step in this process's step tail (`ettr.steptail`), for the supervisor to recover the steps
    a kill takes before the recorder writes them."""
    from ettr.steptail import StepTail, tail_path

    assert rec.run_dir is not None
    tail = StepTail(tail_path(rec.run_dir, rec.rank), run_dir=rec.run_dir)

    def note(step: int) -> None:
        tail.note(rec.attempt, step)

    _started["tail_listener"] = note
    rec.add_step_listener(note)


def _mark_first_step(rec: RecorderProtocol, run_env: RunEnv) -> None:
    """At this process's first step, write `trained_path`: the supervisor then knows that the start-up is
    over and starts the next attempt's standbys (`ettr.supervisor.standby`), which import ahead the
    installed packages and the packages of torch and ettr the file names (`installed_packages`, `imported_parts`).
    One file, once."""
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
            from ettr.untrusted import make_dirs_below

            make_dirs_below(run_env.run_dir, path.parent)  # never through a symlinked agent/
            # a hint, not a record: not fsync'd on the training thread
            learned = [*installed_packages(), *imported_parts()]
            create_exclusive(path, json.dumps({"modules": learned}), durable=False)
        except Exception:
            pass  # there already, or no place for it: the supervisor then waits for its fallback delay
        for action in _started.get("first_step", ()):  # `at_first_step`
            try:
                action()
            except Exception:
                pass

    _started["first_step_listener"] = on_step
    rec.add_step_listener(on_step)


def become_forked_rank(rank: int, world_size: int, parent: int) -> bool:
    """In a child that multiprocessing's `fork` start method made of this attempt's lone instrumented process
    (`parent`), joining a process group as `rank` of `world_size` (`ettr.bootstrap.spawned.watch_forks`):
    record as that rank from here on, through a ledger connection of its own, with its own heartbeat, step
    tail and first-step marker; the parent is told it is a launcher at this process's first step. The hooks
    the child inherited stay (they hold the same recorder, reopened). Whether it did; never raises."""
    from ettr.heartbeat import MainThreadHeartbeat
    from ettr.recorder import Recorder
    from ettr.run_env import (
        INSTRUMENTED_ENV,
        INSTRUMENTED_WORLD_ENV,
        OWN_RANK_ENV,
        OWN_WORLD_SIZE_ENV,
        RankEnv,
        heartbeat_path,
    )
    from ettr.runtime import open_process_ledger, record_process_start

    rec, run_env = _started.get("recorder"), _started.get("run_env")
    if type(rec) is not Recorder or rec.enabled or run_env is None or rec.run_dir is None:
        return False  # not a forked copy of an instrumented process (its recorder is off in the child)
    try:
        ledger = open_process_ledger(run_env)
    except Exception as exc:
        logger.warning("ettr: forked rank %d will not be recorded (%s: %s)", rank, type(exc).__name__, exc)
        return False
    try:
        environ = os.environ
        environ[OWN_RANK_ENV], environ[OWN_WORLD_SIZE_ENV] = str(rank), str(world_size)
        environ[INSTRUMENTED_ENV], environ[INSTRUMENTED_WORLD_ENV] = str(os.getpid()), str(world_size)
        rec.reopen_in_child(ledger, rank=rank, world_size=world_size)
        record_process_start(
            rec, RankEnv.from_environ(environ).local_rank, supervisor_pid=run_env.supervisor_pid
        )
        for key in ("tail_listener", "first_step_listener"):  # the parent's files: its pid, its rank
            listener = _started.pop(key, None)
            if listener is not None:
                rec.remove_step_listener(listener)
        _started["first_step"] = [lambda: tell_launcher(parent, b"fork")]  # the parent's are not this one's
        _keep_step_tail(rec)
        _mark_first_step(rec, run_env)
        inherited = _started.pop("injector", None)  # the parent's faults, and it stands down with the parent
        if inherited is not None:
            rec.remove_step_listener(inherited.on_step)
        _start_injector(rec, run_env)  # this rank's `--inject` faults
        beat = MainThreadHeartbeat(
            heartbeat_path(rec.run_dir, rec.attempt, rank),
            progress=_started.get("progress"),
            run_dir=rec.run_dir,
        )
        beat.start()
        _started["heartbeat"] = beat
        _started["forked_rank"] = True
        return True
    except Exception as exc:
        logger.warning("ettr: forked rank %d may be recorded in part (%s: %s)", rank, type(exc).__name__, exc)
        return True


def end_forked_rank() -> None:
    """A forked rank's `run` returned or raised: multiprocessing ends the process with `os._exit` (no exit
    handlers), so its recorder's last events are written now. Never raises."""
    if not _started.get("forked_rank"):
        return
    try:
        beat = _started.get("heartbeat")
        if beat is not None:
            beat.stop()
        rec = _started.get("recorder")
        if rec is not None:
            rec.flush(timeout_s=5.0)
    except Exception:
        pass


def _mark_failed_exit_last(run_env: RunEnv) -> None:
    """After every other exit handler (atexit runs the first registered last; this is registered before
    the recorder's and the script's), a process that ends on an uncaught exception writes
    `failed_exit_path` and ends at once with status 1 (what Python exits with then): only the
    interpreter's teardown was left -- freeing torch's modules, seconds under load, during which a
    launcher above it (ettr's agent, the real torchrun, a torchrun in a shell script) and so the restart
    would wait; ettr's agent used to SIGKILL it at that point, others waited. Any other exit writes
    `exited_path` (its teardown is not a hang) and exits as usual (its status is not known here)."""
    import atexit

    def mark() -> None:
        from ettr.bootstrap.spare import is_held

        if is_held():
            return  # a spare ended before its promotion: it was no process of any attempt
        uncaught = bool(_started.get("uncaught"))
        try:
            from ettr.atomic import create_exclusive
            from ettr.run_env import exited_path, failed_exit_path
            from ettr.untrusted import make_dirs_below

            where = failed_exit_path if uncaught else exited_path
            now = _started.get("run_env") or run_env  # the attempt it is in now (`continue_attempt`)
            path = where(now.run_dir, now.attempt, os.getpid())
            make_dirs_below(now.run_dir, path.parent)  # never through a symlinked agent/
            create_exclusive(path, b"")
        except Exception:
            pass
        if uncaught:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(1)

    atexit.register(mark)
    _started["exit_marked"] = True


def _watch_frameworks(hooks: Any) -> None:
    from ettr.bootstrap.frameworks import TRAINER_MODULES, FrameworkHooks
    from ettr.post_import import when_imported

    frameworks = FrameworkHooks(hooks.rec, guard=hooks.guard, patcher=hooks.patcher)
    for name in TRAINER_MODULES:
        when_imported(name, frameworks.on_import)


def _is_launcher_now() -> bool:
    """Whether this instrumented process has been told it is the ranks' launcher (`tell_launcher`: it ran
    torchrun's agent in-process, spawned the ranks, or started a torchrun). Never raises."""
    from ettr.run_env import RunEnv, launcher_parent_path

    try:
        run_env = RunEnv.from_environ(os.environ)
        return (
            run_env is not None
            and launcher_parent_path(run_env.run_dir, run_env.attempt, os.getpid()).exists()
        )
    except Exception:
        return False


def _launches_torchrun(run_env: RunEnv) -> Callable[[], bool] | None:
    """For a process that may start a torchrun of its own (not a torchrun worker): whether it did, so that
    it is a launcher and not a rank (`hand_ranks_to_workers` says so in `launcher_parent_path`)."""
    from ettr.run_env import Launcher, launcher_parent_path

    if run_env.launcher is Launcher.TORCHRUN:
        return None
    path = launcher_parent_path(run_env.run_dir, run_env.attempt, os.getpid())
    return path.exists


def _start_injector(
    rec: RecorderProtocol, run_env: RunEnv, *, stands_down: Callable[[], bool] | None = None
) -> None:
    from ettr import inject

    specs = inject.decode_specs(run_env.inject)
    if not specs:
        return
    injector = inject.Injector(
        specs, rec, attempt_started_at=run_env.attempt_started_at, stands_down=stands_down
    )
    inject.install(injector if injector.specs else None)
    if injector.specs:
        injector.start()
        _started["injector"] = injector


def continue_attempt(attempt: int) -> None:
    """This training process goes on in attempt `attempt`: ettr's agent restarted the job in place
    (`ettr.inplace`) and booked the next attempt while this process lives on. Its events, heartbeat,
    first-step marker, exit markers and injected faults become the new attempt's. Never raises."""
    import dataclasses
    import time

    from ettr.run_env import ATTEMPT_ENV, heartbeat_path

    try:
        os.environ[ATTEMPT_ENV] = str(attempt)
        rec = _started.get("recorder")
        run_env = _started.get("run_env")
        if rec is None or run_env is None:
            return
        rec.set_attempt(attempt)
        run_env = dataclasses.replace(run_env, attempt=attempt, attempt_started_at=time.time())
        _started["run_env"] = run_env
        beat = _started.get("heartbeat")
        if beat is not None and rec.run_dir is not None:
            from ettr.heartbeat import MainThreadHeartbeat

            beat.stop()
            progress = _started.get("progress")
            beat = MainThreadHeartbeat(
                heartbeat_path(rec.run_dir, attempt, rec.rank), progress=progress, run_dir=rec.run_dir
            )
            beat.start()
            _started["heartbeat"] = beat
        _mark_first_step(rec, run_env)
        hooks = _started.get("hooks")
        if hooks is not None:  # zero-code steps: the new generation's optimizer, counted from its resume
            hooks.new_generation()
        injector = _started.get("injector")
        if injector is not None:
            injector.continue_attempt(run_env.attempt_started_at)
        else:
            _start_injector(rec, run_env)
    except Exception as exc:
        logger.warning("ettr: could not move this process's books to attempt %d (%s)", attempt, exc)


def _hold(environ: MutableMapping[str, str]) -> None:
    """A spare's start (`ettr.bootstrap.spare`): its children (loader workers) are not instrumented, and the
    exit marker is registered first (so that it runs last, as `_start` has it) but writes nothing while the
    spare is held. Nothing else: no recorder, heartbeat, step tail, injector, hooks. Never raises."""
    from ettr.bootstrap import spare
    from ettr.run_env import INSTRUMENTED_ENV, INSTRUMENTED_WORLD_ENV, SPARE_ENV, Launcher, RankEnv, RunEnv

    try:
        spare.hold(environ[SPARE_ENV])
        os.environ[INSTRUMENTED_ENV] = str(os.getpid())
        os.environ[INSTRUMENTED_WORLD_ENV] = str(RankEnv.from_environ(os.environ).world_size)
        run_env = RunEnv.from_environ(environ)
        if run_env is not None and run_env.launcher is Launcher.TORCHRUN:
            _mark_failed_exit_last(run_env)
    except Exception as exc:
        logger.warning("ettr: spare set-up failed (%s: %s)", type(exc).__name__, exc)


def promote_spare(started_at: float, fields: Mapping[str, Any]) -> None:
    """A spare promoted into its attempt (`ettr.bootstrap.spare`): it starts now, as a process of the attempt
    (its PROCESS_START at `started_at`): the recorder the script made while it was held records from here
    on, then the bootstrap instruments it as at any start, and its `spare` MARK says where it came from
    (`fields`: when it was forked, parked, promoted). Never raises."""
    try:
        import ettr.runtime

        ettr.runtime.process_start_time = lambda: started_at
        ettr.runtime.release_held_recorder()
        _start(os.environ)
        rec = ettr.runtime.get_recorder()
        rec.mark("spare", **fields, pid=os.getpid())
        rec.flush(1.0)  # its start is in the books before a stop signal can end it unwritten
    except Exception as exc:
        logger.warning("ettr: bootstrap of the promoted spare failed (%s: %s)", type(exc).__name__, exc)
