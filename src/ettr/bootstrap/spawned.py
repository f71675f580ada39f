"""Ranks that the script's own process starts (`torch.multiprocessing.spawn`, torchrun's agent run in-process,
Lightning's launchers): those processes are the training ranks, the process that started them a launcher.

PyTorch's DDP tutorial and many public scripts start their ranks themselves, not through torchrun:

    def main(rank, world_size): init_process_group("gloo", rank=rank, world_size=world_size); ...train...
    if __name__ == "__main__": mp.spawn(main, args=(2,), nprocs=2)

Under `ettr run -- python train.py` the script's process is the attempt's first Python process, so the
bootstrap instruments it, and the processes it spawns carry its marker (`ETTR_INSTRUMENTED_PID`), as data-loader
workers do: left alone, every step is in processes nobody records and the books say "no training step".
Here, in the instrumented process, `start_processes` (which `spawn` calls) is wrapped: with the `spawn` or
`forkserver` start method, in a process that is not a rank itself (no world size above 1) and has not
trained, the function it starts becomes `SpawnedRank(fn, nprocs)`, which in process `i` first makes
that process rank `i` of `nprocs` (ettr's own `ETTR_RANK`, `ETTR_WORLD_SIZE`: the script's environment is
left as it was) and starts ettr's bootstrap there, then runs `fn(i, *args)`; an exception out of `fn` is
recorded as that rank's FAILURE (torch's own wrapper catches it before any excepthook would). The program that spawned them says it
is a launcher once one of them takes a step (`ettr.run_env.launcher_parent_path`, as when it starts a
torchrun): it fires no `--inject` fault and its heartbeat stops; helpers it spawns that never train (a
preprocessing pool before it trains itself) leave it a rank. The rank is the process index: a script that numbers its ranks otherwise
(several nodes, each spawning its own) is recorded under the index. With the `fork` start method see
below.

A program that runs torchrun's agent in its own process (`torch.distributed.run.main()`, `elastic_launch`)
becomes a launcher when the agent starts: its workers are the ranks (`_wrap_agent`; a function entrypoint's
workers get their rank's environment before the bootstrap starts: `ElasticWorker`).

Lightning's `strategy="ddp"` run as `python train.py` starts the other local ranks as new runs of the script
(`_SubprocessScriptLauncher`): they are started without the marker and with `ETTR_RANK_BASE`, so that each is
instrumented under its global rank (`_wrap_lightning`).

PyTorch's "Writing Distributed Applications" tutorial starts its ranks with multiprocessing itself, one
`mp.Process(target=init_process, args=(rank, size, run))` each (start method `spawn`), and passes the rank to
`init_process_group(backend, rank=rank, world_size=size)`; nothing torch-specific starts them, so nothing above
sees them. A process that multiprocessing started with its `spawn` or `forkserver` method under the
instrumented process (it carries that process's marker) is therefore watched (`watch_join`, from the
bootstrap's sitecustomize): when it joins a process group of more than one rank (its rank and world size from
`init_process_group`'s arguments, its `init_method`'s query, or `RANK`/`WORLD_SIZE`), it becomes that rank
(`become_rank`) before the group forms, and the process that started it is told it is a launcher at its first
step, as with `torch.multiprocessing.spawn`. It is not watched when it inherited a rank (a helper of a torchrun,
spawned, srun or MPI rank), and does not become one when the process that started it has trained (that
process's helpers). An exception out of a `Process`'s `run` is recorded as the rank's FAILURE
(multiprocessing catches it before any excepthook). Processes forked with the `fork` method (Python 3.11's
default on Linux) are copies of the instrumented process, its hooks installed and its recorder switched off:
one that joins a process group of several ranks before its parent has trained becomes that rank
(`watch_forks`: the hooks' own `init_process_group` wrapper, which the script calls, sees the join first; the
inherited recorder is reopened with a ledger connection of the child's own); others (data-loader workers)
record nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ettr.bootstrap.unrecorded import watch_steps
from ettr.patcher import Patcher

logger = logging.getLogger("ettr")

SPAWN_METHODS = frozenset({"spawn", "forkserver"})
"""Start methods whose children run the bootstrap afresh (a new interpreter, or a fork of a fresh server)."""

_patcher = Patcher()


class SpawnedRank:
    """`fn` as `start_processes` runs it in process `i` of `nprocs`, made rank `i` first (pickled by
    reference to this class, with `fn` as `start_processes` would pickle it)."""

    def __init__(self, fn: Callable[..., Any], nprocs: int) -> None:
        self.fn = fn
        self.nprocs = nprocs
        self.spawner = os.getpid()

    def __call__(self, i: int, *args: Any) -> Any:
        from ettr.bootstrap.start import at_first_step, tell_launcher

        become_rank(i, self.nprocs)
        at_first_step(lambda: tell_launcher(self.spawner, b"spawn"))
        return _recorded(self.fn, i, *args)


def _recorded(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a rank, its exception recorded as the rank's FAILURE (the process's runner catches it
    before any excepthook would)."""
    from ettr.bootstrap.start import record_uncaught

    try:
        return fn(*args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        record_uncaught(exc)
        raise


ELASTIC_WORKER = ("torch.distributed.elastic.multiprocessing.api", "_wrap")
"""What torch elastic's agent starts in each worker process when its entrypoint is a function (`elastic_launch(
config, train)(...)`: Hugging Face's `notebook_launcher`, a framework's own launcher): `_wrap(local_rank, fn,
args, envs, ...)`, which puts the worker's `RANK`, `TORCHELASTIC_RUN_ID`, ... (`envs[local_rank]`) into its
environment only then, after the interpreter started: the bootstrap had found no rank there, and every step was
in processes nobody recorded (ETT unknown)."""


class ElasticWorker:
    """Torch elastic's `_wrap` (`ELASTIC_WORKER`) as `start_processes` runs it in a worker: the worker's
    environment (`envs[local_rank]`, which `_wrap` sets the same way just after) is put in place first, then
    ettr's bootstrap starts (it is a rank of the agent this process's spawner became: `_become_agent`), then
    `_wrap` runs. Pickled by reference to this class."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, local_rank: int, *args: Any) -> Any:
        from ettr.bootstrap.start import start

        try:
            env = args[2].get(local_rank) if len(args) > 2 and isinstance(args[2], dict) else None
            if isinstance(env, dict):
                os.environ.update({str(k): str(v) for k, v in env.items()})
            start()
        except Exception as exc:
            logger.warning(
                "ettr: could not instrument elastic worker %d (%s: %s)", local_rank, type(exc).__name__, exc
            )
        return _recorded(self.fn, local_rank, *args)


def _is_elastic_worker(fn: object) -> bool:
    return (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) == ELASTIC_WORKER


def become_rank(i: int, nprocs: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Make this spawned process rank `i` of `nprocs` and instrument it (never raises). Only ettr's own names
    say so (`ETTR_RANK`, `ETTR_WORLD_SIZE`): the script's `RANK`, `WORLD_SIZE`, `LOCAL_RANK` stay as it has
    them (some scripts take a set `RANK` for a torchrun launch)."""
    from ettr.run_env import INSTRUMENTED_ENV, INSTRUMENTED_WORLD_ENV, OWN_RANK_ENV, OWN_WORLD_SIZE_ENV

    environ = os.environ if environ is None else environ
    environ.pop(INSTRUMENTED_ENV, None)  # the spawner's marker: this process is a rank, not its helper
    environ.pop(INSTRUMENTED_WORLD_ENV, None)
    environ[OWN_RANK_ENV] = str(i)
    environ[OWN_WORLD_SIZE_ENV] = str(nprocs)
    try:
        from ettr.bootstrap.start import start

        start(environ)
    except Exception as exc:
        logger.warning("ettr: could not instrument spawned rank %d (%s: %s)", i, type(exc).__name__, exc)


LIGHTNING_LAUNCHERS = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning.pytorch.strategies.launchers.subprocess_script",
    "lightning_fabric.strategies.launchers.subprocess_script",
    "pytorch_lightning.strategies.launchers.subprocess_script",
)
"""Lightning's launcher that runs the script again for local ranks 1..N-1 (`strategy="ddp"` run as `python
train.py`), in each of its packages."""


def install(run_dir: str, attempt: int) -> None:
    """In the attempt's instrumented process: wrap torch's `start_processes` once torch.multiprocessing is
    imported, and Lightning's subprocess launcher once imported (post-import; this imports neither)."""
    from ettr.post_import import when_imported

    when_imported("torch.multiprocessing", lambda module: _wrap(module, run_dir, attempt))
    for name in LIGHTNING_LAUNCHERS:
        when_imported(name, _wrap_lightning)
    when_imported("torch.distributed.launcher.api", _wrap_agent)


def _wrap_agent(module: ModuleType) -> None:
    """torchrun's agent run inside this process (`torch.distributed.run.main()` or `run(args)` called by a
    program, `elastic_launch`): its workers are the ranks. Before it starts them this process becomes a
    launcher, as a torchrun process is (`ettr.bootstrap.start.hand_ranks_to_workers`): no marker for the
    workers, `ETTR_LAUNCHER=torchrun` (the processes with TORCHELASTIC_RUN_ID are the ranks), and it fires
    no fault and stops beating (`launcher_parent_path` for itself)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def launch_agent(*args: Any, **kwargs: Any) -> Any:
            _become_agent()
            return original(*args, **kwargs)

        return launch_agent

    try:
        _patcher.wrap(module, "launch_agent", make)  # what `elastic_launch.__call__` calls
    except Exception as exc:
        logger.warning(
            "ettr: the ranks of torchrun's agent will not be recorded (%s: %s)", type(exc).__name__, exc
        )


def _become_agent() -> None:
    """This instrumented process becomes what a torchrun process is: told it is a launcher, and its workers
    made the ranks (`hand_ranks_to_workers`)."""
    from ettr.bootstrap.start import hand_ranks_to_workers, tell_launcher
    from ettr.run_env import INSTRUMENTED_ENV

    pid = os.getpid()
    if os.environ.get(INSTRUMENTED_ENV) != str(pid):
        return  # not the instrumented process (or told already)
    tell_launcher(pid, b"agent")
    hand_ranks_to_workers(os.environ, pid)


def _wrap_lightning(module: ModuleType) -> None:
    """Lightning's `strategy="ddp"` under `python train.py`: this process is local rank 0 and trains; it
    starts the script again for local ranks 1..N-1 with `LOCAL_RANK` set (and no `RANK`). Those are ranks
    too: they are started without this process's marker, and with `ETTR_RANK_BASE`, the global rank of
    local rank 0 (`NODE_RANK` x N), so that each is recorded under its global rank."""
    launcher = getattr(module, "_SubprocessScriptLauncher", None)
    if not isinstance(launcher, type) or "_call_children_scripts" not in vars(launcher):
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _call_children_scripts(self: Any, *args: Any, **kwargs: Any) -> Any:
            from ettr.run_env import INSTRUMENTED_ENV, RANK_BASE_ENV, RANK_CLEARS

            if os.environ.get(INSTRUMENTED_ENV) != str(os.getpid()):
                return original(self, *args, **kwargs)
            try:
                base = int(self.cluster_environment.node_rank()) * int(self.num_processes)
            except Exception:
                base = 0
            saved = {
                name: os.environ.pop(name) for name in (INSTRUMENTED_ENV, *RANK_CLEARS) if name in os.environ
            }
            os.environ[RANK_BASE_ENV] = str(base)
            try:
                return original(self, *args, **kwargs)
            finally:  # this process's later children (data-loader workers) are its helpers again
                os.environ.pop(RANK_BASE_ENV, None)
                os.environ.update(saved)

        return _call_children_scripts

    try:
        _patcher.wrap(launcher, "_call_children_scripts", make)
    except Exception as exc:
        logger.warning("ettr: Lightning's other ranks will not be recorded (%s: %s)", type(exc).__name__, exc)


def _wrap(package: ModuleType, run_dir: str, attempt: int) -> None:
    module = sys.modules.get("torch.multiprocessing.spawn")
    if module is None:
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def start_processes(
            fn: Callable[..., Any],
            args: tuple[Any, ...] = (),
            nprocs: int = 1,
            join: bool = True,
            daemon: bool = False,
            start_method: str = "spawn",
        ) -> Any:
            if _is_elastic_worker(fn) and start_method in SPAWN_METHODS:
                fn = ElasticWorker(fn)  # torch elastic's agent in this process: its workers carry their ranks
            elif hands_over(start_method, run_dir, attempt):
                fn = SpawnedRank(fn, nprocs)
            return original(fn, args, nprocs, join, daemon, start_method)

        return start_processes

    try:
        _patcher.wrap(module, "start_processes", make)  # what `torch.multiprocessing.spawn` calls
        _patcher.wrap(package, "start_processes", make)  # `torch.multiprocessing.start_processes`
    except Exception as exc:
        logger.warning("ettr: spawned ranks will not be recorded (%s: %s)", type(exc).__name__, exc)


def hands_over(
    start_method: str, run_dir: str, attempt: int, environ: MutableMapping[str, str] | None = None
) -> bool:
    """Whether the processes this one is about to start with `start_method` are ranks. The first of them to
    take a step tells this one that it is their launcher (`SpawnedRank`): processes it spawns for other work
    (a tokenizer pool before it trains itself) leave it a rank. Never raises."""
    from ettr.run_env import RankEnv, trained_path

    environ = os.environ if environ is None else environ
    try:
        if start_method not in SPAWN_METHODS:
            return False
        if RankEnv.from_environ(environ).world_size > 1:
            return False  # this process is a rank itself: what it spawns are its helpers
        return not trained_path(run_dir, attempt, os.getpid()).exists()  # trained: its helpers
    except Exception as exc:
        logger.warning("ettr: spawned ranks will not be recorded (%s: %s)", type(exc).__name__, exc)
        return False


MULTIPROCESSING_CHILD_ARGS = ("--multiprocessing-fork", "multiprocessing.forkserver")
"""In the command line of a process multiprocessing started with its `spawn` method (the flag), or of its
forkserver (whose forks are that method's children)."""

_join: dict[str, Any] = {}


def started_by_multiprocessing(argv: list[str]) -> bool:
    """Whether `argv` (`sys.orig_argv`) is a `spawn` child's or the forkserver's."""
    return any(mark in arg for arg in argv[1:6] for mark in MULTIPROCESSING_CHILD_ARGS)


def watch_join(environ: MutableMapping[str, str] | None = None) -> None:
    """In a process multiprocessing started (`spawn`, `forkserver`) under the instrumented process: become a
    rank when joining a process group of several ranks (see the module docstring). Called by the bootstrap's
    sitecustomize; imports nothing of torch; never raises."""
    from ettr.post_import import when_imported
    from ettr.run_env import INSTRUMENTED_ENV, RunEnv

    environ = os.environ if environ is None else environ
    try:
        run_env = RunEnv.from_environ(environ)
        spawner = int(environ.get(INSTRUMENTED_ENV, ""))
        if run_env is None or spawner == os.getpid() or inherited_rank(environ):
            return
        _join.update(spawner=spawner, run_dir=run_env.run_dir, attempt=run_env.attempt)
        when_imported("torch.distributed", _wrap_join)
        when_imported("multiprocessing.process", _wrap_process_run)
        when_imported("torch.optim.optimizer", watch_steps)  # steps it takes without becoming a rank
    except Exception as exc:
        logger.warning("ettr: this process will not be recorded as a rank (%s: %s)", type(exc).__name__, exc)


def inherited_rank(environ: Mapping[str, str]) -> bool:
    """Whether this process inherited a rank's place: it is a helper of a torchrun, spawned, srun or MPI rank."""
    from ettr.run_env import RankEnv

    return inherited_torchrun(environ) or RankEnv.from_environ(environ).world_size > 1


def joining_as(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any], environ: Mapping[str, str]
) -> tuple[int, int] | None:
    """(rank, world size) that this call of `init_process_group` joins as, when it is a group of several ranks
    and both are known; else None. Never raises."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
        rank, world_size = bound.get("rank", -1), bound.get("world_size", -1)
        init_method = bound.get("init_method")
        if isinstance(init_method, str) and "?" in init_method:  # tcp://host:port?rank=1&world_size=2
            query = parse_qs(urlsplit(init_method).query)
            rank = int(query["rank"][0]) if rank in (None, -1) and "rank" in query else rank
            if world_size in (None, -1) and "world_size" in query:
                world_size = int(query["world_size"][0])
        rank = int(environ.get("RANK", "-1")) if rank in (None, -1) else int(rank)
        world_size = int(environ.get("WORLD_SIZE", "-1")) if world_size in (None, -1) else int(world_size)
    except (TypeError, ValueError, KeyError, IndexError):
        return None
    return (rank, world_size) if world_size > 1 and 0 <= rank < world_size else None


def _wrap_join(dist: ModuleType) -> None:
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None or not callable(getattr(c10d, "init_process_group", None)):
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            spawner = _join.pop("spawner", None)  # the first group this process joins decides
            if spawner is not None and _becomes_rank(spawner, signature, args, kwargs):
                current = getattr(c10d, "init_process_group", None)
                if callable(current) and current is not init_process_group:
                    return current(*args, **kwargs)  # through the hooks the rank's bootstrap just installed
            return original(*args, **kwargs)

        return init_process_group

    before = c10d.init_process_group
    _patcher.wrap(c10d, "init_process_group", make)
    if getattr(dist, "init_process_group", None) is before:
        _patcher.set(dist, "init_process_group", c10d.init_process_group)


def _becomes_rank(
    spawner: int, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Make this process the rank it joins as, unless `spawner`, the process that started it, has trained.
    Never raises."""
    from ettr.bootstrap.start import at_first_step, tell_launcher
    from ettr.run_env import INSTRUMENTED_ENV, trained_path

    try:
        if INSTRUMENTED_ENV not in os.environ or os.environ[INSTRUMENTED_ENV] == str(os.getpid()):
            return False  # a rank already (`torch.multiprocessing.spawn`'s `SpawnedRank`): numbered by it
        place = joining_as(signature, args, kwargs, os.environ)
        if place is None or trained_path(_join["run_dir"], _join["attempt"], spawner).exists():
            return False
        become_rank(*place)
        at_first_step(lambda: tell_launcher(spawner, b"spawn"))
        return True
    except Exception as exc:
        logger.warning("ettr: this process will not be recorded as a rank (%s: %s)", type(exc).__name__, exc)
        return False


def _wrap_process_run(module: ModuleType) -> None:
    """`multiprocessing.process.BaseProcess.run`: its exception, in a process that became a rank, is that rank's
    FAILURE (multiprocessing prints it and exits 1; no excepthook sees it). A forked rank's events are written
    when `run` ends (`end_forked_rank`: multiprocessing then leaves with `os._exit`)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any) -> Any:
            try:
                return original(self)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                from ettr.bootstrap.start import record_uncaught

                record_uncaught(exc)  # nothing where this process is not an instrumented rank
                raise
            finally:
                if _join.get("forked"):
                    from ettr.bootstrap.start import end_forked_rank

                    end_forked_rank()

        return run

    _patcher.wrap(module.BaseProcess, "run", make)


_forks_watched: list[int] = []  # the pid that registered `watch_forks`' at-fork handler (once a process)


def watch_forks(run_dir: str, attempt: int) -> None:
    """In the attempt's lone instrumented process that may start its ranks itself (where `install` wraps
    `start_processes`): a child forked from it (multiprocessing's `fork` start method, Python 3.11's default on
    Linux: `mp.Process(target=run, args=(rank, size)).start()`) that joins a process group of several ranks
    before its parent has trained becomes that rank (`ettr.bootstrap.start.become_forked_rank`). Without it
    such a child is a copy of its parent, recorder switched off, whose step listeners still wrote the
    parent's step tail: every rank's steps in one file, a rank's failure never recorded, a job whose ranks
    all died booked `completed`. Children that never join (data-loader workers) are left as they were.
    Registers one at-fork handler per process; never raises."""
    try:
        if _forks_watched or not hasattr(os, "register_at_fork"):
            return
        parent = os.getpid()
        _forks_watched.append(parent)
        os.register_at_fork(after_in_child=lambda: _forked_child(parent, run_dir, attempt))
    except Exception as exc:
        logger.warning("ettr: forked ranks will not be recorded (%s: %s)", type(exc).__name__, exc)


def _forked_child(parent: int, run_dir: str, attempt: int) -> None:
    """Right after a fork, in the child: arm the join watch when the child is `parent`'s own (not a
    grandchild). Cheap, imports nothing, never raises."""
    try:
        if os.getppid() != parent:
            return
        watch_steps()  # steps it takes without becoming a rank
        hooks = sys.modules.get("ettr.bootstrap.hooks")
        if hooks is None:
            return  # no zero-code hooks (ETTR_AUTO=0): nothing wraps the script's init_process_group
        _join.clear()
        _join.update(spawner=parent, run_dir=run_dir, attempt=attempt, forked=True)
        hooks.JOIN_WATCH = _forked_join  # type: ignore[attr-defined]
        process = sys.modules.get("multiprocessing.process")
        if process is not None:
            _wrap_process_run(process)
    except Exception:
        pass


def _forked_join(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The first `init_process_group` of a forked child (`watch_forks`): become the rank it joins as, unless
    the parent has trained (then the child is its helper). Never raises."""
    from ettr.run_env import trained_path

    hooks = sys.modules.get("ettr.bootstrap.hooks")
    if hooks is not None:
        hooks.JOIN_WATCH = None  # type: ignore[attr-defined]  # the first group this process joins decides
    spawner = _join.pop("spawner", None)
    if spawner is None:
        return
    try:
        place = joining_as(inspect.signature(original), args, kwargs, os.environ)
        if place is None or trained_path(_join["run_dir"], _join["attempt"], spawner).exists():
            return
        from ettr.bootstrap.start import become_forked_rank

        become_forked_rank(*place, spawner)
    except Exception as exc:
        logger.warning("ettr: this process will not be recorded as a rank (%s: %s)", type(exc).__name__, exc)


LAUNCHED_WORLD_NAMES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""The world-size names the bootstrap's sitecustomize looks at before `launched_rank` (spelt out there)."""


def launched_rank(environ: MutableMapping[str, str] | None = None) -> None:
    """In a Python process the instrumented one started while alone (`INSTRUMENTED_WORLD_ENV` 1) with a rank of
    a larger world in its environment (`RANK`/`WORLD_SIZE` a launcher program of the user's set, MPI's names:
    `subprocess.Popen([python, "worker.py"], env={..., "RANK": r, "WORLD_SIZE": n})`, composer's launcher,
    `mpirun` run by a Python program): it is that rank, and the program that started it a launcher, told at its
    first step; unless that program has trained (then this is its helper). Called by the bootstrap's
    sitecustomize; never raises."""
    from ettr.run_env import INSTRUMENTED_ENV, INSTRUMENTED_WORLD_ENV, RankEnv, RunEnv, trained_path

    environ = os.environ if environ is None else environ
    try:
        run_env = RunEnv.from_environ(environ)
        spawner = int(environ.get(INSTRUMENTED_ENV, ""))
        if run_env is None or spawner == os.getpid() or environ.get(INSTRUMENTED_WORLD_ENV) != "1":
            return
        if inherited_torchrun(environ) or RankEnv.from_environ(environ).world_size <= 1:
            return
        if trained_path(run_env.run_dir, run_env.attempt, spawner).exists():
            return
        environ.pop(INSTRUMENTED_ENV, None)
        environ.pop(INSTRUMENTED_WORLD_ENV, None)
        from ettr.bootstrap.start import at_first_step, start, tell_launcher

        start(environ)
        at_first_step(lambda: tell_launcher(spawner, b"launcher"))
    except Exception as exc:
        logger.warning("ettr: this process will not be recorded as a rank (%s: %s)", type(exc).__name__, exc)


def inherited_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether this process is under a torchrun worker (its helpers carry TORCHELASTIC_RUN_ID)."""
    from ettr.run_env import TORCHELASTIC_RUN_ID_ENV

    return bool(environ.get(TORCHELASTIC_RUN_ID_ENV))
