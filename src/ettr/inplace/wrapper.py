"""`ettr.resilient`: run a training function so that a rank's failure restarts it in place.

    def train(gen: ettr.Generation) -> None:        # the default process group is set up (gen.rank, ...)
        model = DistributedDataParallel(build_model())
        with CheckpointManager.create(config, TrainState(model=model, ...)) as ckpt:
            step = ckpt.restore() or 0              # every generation: from memory where it can
            while step < num_steps:
                ...
            ckpt.finish(step)

    ettr.resilient(train)()                         # or @ettr.resilient on `train`

Each call of `train` is a generation. When it raises on any rank — its own error, or a collective failing
because a peer died or failed — the surviving processes do not exit: `train` unwinds (its `with` blocks
close), the wrapper tears the process groups down (so peers blocked on this rank fail at once), waits for
the next generation (`generations`), joins it with the failed rank's replacement on fresh store keys
(`rendezvous`) and calls `train` again, which restores the last commit (from memory: `ettr.checkpoint.
memory`). Where a failure cannot be recovered in place (no next generation in `rendezvous_timeout_s`, more
than `max_restarts`, a SystemExit such as a preemption's 143) the process exits with it, and the launcher's
process restart follows.

Under `ettr run`, in-place restarts need ettr's own torchrun agent (it sets `ETTR_INPLACE=1`): it books each
one as an attempt and starts a replacement for a rank that died. Under any other supervision (the real
torchrun under `ettr run`, several nodes) the wrapper runs `train` once and a failure ends the process as
without it, so that every recovery is in the books. Without `ettr run`, a failure a process survives (an
exception) is restarted in place among the same processes; a rank that died is not replaced, so its peers
time out and exit, and torchrun restarts the job.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ettr import torch_compat
from ettr.bootstrap.spare import is_held, park
from ettr.events import Phase
from ettr.inplace import rendezvous
from ettr.inplace.config import InPlaceConfig
from ettr.inplace.generations import AgentGenerations, Generations, GenerationTimeout, StoreGenerations
from ettr.inplace.store import JobStore, open_job_store
from ettr.run_env import GROUP_FORM_TIMEOUT_ENV, INPLACE_ENV, RankEnv, RunEnv

logger = logging.getLogger("ettr")

T = TypeVar("T")

_DEAD_PEER_LOOK_S = 0.5
"""How often a rank whose `train` returned looks whether a peer it waits for died (`rendezvous.dead_peer`)."""
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout|Timed out waiting|"
    r"NCCL communicator was aborted|ProcessGroup.*(abort|shut ?down)|Connection refused",
    re.IGNORECASE,
)
"""What a collective says when it failed because of a peer (it died, failed or left): not this rank's own
failure."""


@dataclass(kw_only=True)
class Generation:
    """One run of the training function: where it stands (see the module docstring)."""

    index: int
    """The generation's number (under ettr's agent: the attempt of the job's books)."""
    rank: int
    world_size: int
    store: dist.Store
    """This generation's own keys in the job's store (for a rendezvous of the function's own)."""
    keep: dict[str, Any] = field(default_factory=dict)
    """Objects this process keeps from one generation to the next (datasets, an unwrapped model): the same
    dict every call. A replacement process starts with it empty. Nothing that holds a process group
    (DistributedDataParallel, a CheckpointManager) may be kept: its connections would stay open."""
    restarts: int = 0
    """In-place restarts this process has taken part in before this generation."""


def resilient(fn: Callable[..., T] | None = None, *, config: InPlaceConfig | None = None) -> Any:
    """`fn(gen, *args, **kwargs)` restarted in place on failures (see the module docstring). Use as
    `ettr.resilient(fn)(*args)`, `@ettr.resilient` or `@ettr.resilient(config=InPlaceConfig(...))`."""
    if fn is None:
        return lambda f: resilient(f, config=config)
    settings = config or InPlaceConfig()

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        return _Runner(settings).run(fn, args, kwargs)

    return run


class _Runner:
    def __init__(self, config: InPlaceConfig) -> None:
        self.config = config
        self.backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        ranks = RankEnv.from_environ()
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.run_env = RunEnv.from_environ()

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        if is_held():  # a spare of ettr's agent: what needs no group is done before it parks
            import_before_first_group()
        if park():  # a spare promoted just now: its attempt's environment is complete now
            self.run_env = RunEnv.from_environ()
        supervised = self.run_env is not None and self.run_env.supervisor_pid is not None
        if supervised and os.environ.get(INPLACE_ENV) != "1":
            return self._once(fn, args, kwargs)
        job_store = open_job_store(
            rank=self.rank, world_size=self.world_size, timeout_s=self.config.rendezvous_timeout_s
        )
        generations: Generations
        if supervised:
            assert self.run_env is not None
            generations = AgentGenerations(Path(self.run_env.run_dir), self.run_env.attempt)
        else:
            generations = StoreGenerations(job_store.store)
        completed = False
        form_s = min(self.config.rendezvous_timeout_s, self.config.collective_timeout_s)
        told = os.environ.get(
            GROUP_FORM_TIMEOUT_ENV
        )  # a group `train` makes forms under the rendezvous bound
        os.environ[GROUP_FORM_TIMEOUT_ENV] = f"{form_s:g}"
        try:
            result = self._loop(fn, args, kwargs, job_store, generations)
            completed = True  # every rank returned from the generation: nobody waits on this rank
            return result
        finally:
            if told is None:
                os.environ.pop(GROUP_FORM_TIMEOUT_ENV, None)
            else:
                os.environ[GROUP_FORM_TIMEOUT_ENV] = told
            if dist.is_initialized():
                rendezvous.leave(self.backend, exiting=True, collect=not completed)
            if self.rank == 0:
                job_store.close()

    def _once(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """Under a supervisor that cannot restart in place: one generation, over the usual env:// store."""
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size)
        gen = Generation(
            index=self.run_env.attempt if self.run_env else 0,
            rank=self.rank,
            world_size=self.world_size,
            store=rendezvous.generation_store(torch_compat.default_store(), 0),
        )
        try:
            result = fn(gen, *args, **kwargs)
            from ettr.runtime import get_recorder

            get_recorder().training_ended()  # as `_loop` records it: the restart policy's evidence
            return result
        finally:
            rendezvous.leave(self.backend, exiting=True)

    def _loop(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        job_store: JobStore,
        generations: Generations,
    ) -> T:
        import_before_first_group()
        from ettr.runtime import get_recorder

        gc.freeze()  # what exists now (imports, the script's set-up) is never scanned by the teardown's collect
        keep: dict[str, Any] = {}
        generation = generations.first()
        restarts = 0
        failure: _Failure | None = None
        while True:
            try:
                with get_recorder().phase(Phase.PROCESS_GROUP_INIT, generation=generation):
                    joined = rendezvous.join(
                        job_store.store,
                        generation,
                        rank=self.rank,
                        world_size=self.world_size,
                        backend=self.backend,
                        timeout_s=self.config.rendezvous_timeout_s,
                        collective_timeout_s=self.config.collective_timeout_s,
                        moved_on=generations.moved_on,
                    )
            except rendezvous.GenerationMovedOn:
                generation = self._next(
                    generations, generation, failure, "overtaken while it formed", own=False
                )
                continue
            generations.joined(generation)
            rendezvous.announce(rendezvous.generation_store(job_store.store, generation), self.rank)
            if failure is not None:
                _record_rejoined(generation, failure, joined)
            gen = Generation(
                index=generation,
                rank=self.rank,
                world_size=self.world_size,
                store=rendezvous.generation_store(job_store.store, generation),
                keep=keep,
                restarts=restarts,
            )
            try:
                result = fn(gen, *args, **kwargs)
                get_recorder().training_ended()  # the restart policy's evidence: nothing left to train
                del gen
                if self._completed(job_store.store, generation, generations):
                    return result
                failure = _Failure(
                    time.time(), time.monotonic(), "a peer failed after this rank finished", False
                )
            except (SystemExit, KeyboardInterrupt):
                raise
            except Exception as exc:
                if _stop_underway():
                    raise  # the process was told to stop: it exits (see `_stop_underway`)
                if isinstance(exc, ValueError) and "default process group twice" in str(exc):
                    raise InPlaceGaveUp(
                        "ettr: train called init_process_group, but ettr.resilient makes the default process "
                        "group itself for each generation: remove the script's own init_process_group and "
                        "destroy_process_group (docs/inplace.md, 'Porting a DDP script')"
                    ) from None  # every restart would fail the same way (it restarted max_restarts times)
                del gen
                failure = self._failed(exc, generation, generations)
            failure.teardown_s, released = rendezvous.leave(
                self.backend, release_wait_s=self.config.release_wait_s
            )
            if not released:
                # Its connections stay open: peers blocked on this rank would wait for the collective
                # timeout. Exiting closes them; the launcher's restart (or the agent's replacement) follows.
                get_recorder().mark("inplace_gave_up", generation=generation, reason="group held")
                get_recorder().flush(timeout_s=2.0)
                raise InPlaceGaveUp(
                    "ettr: the failed generation's process group is still referenced (kept across "
                    "generations in Generation.keep, by a module imported meanwhile, or by a thread still "
                    f"running: the warning before this says what holds it); exiting: {failure.error}"
                )
            restarts += 1
            if restarts > self.config.max_restarts:
                get_recorder().mark("inplace_gave_up", generation=generation, restarts=restarts - 1)
                raise InPlaceGaveUp(
                    f"ettr: {restarts - 1} in-place restarts used up (InPlaceConfig.max_restarts); "
                    f"exiting: {failure.error}"
                )
            generation = self._next(generations, generation, failure, failure.error, own=failure.own)

    def _failed(self, exc: Exception, generation: int, generations: Generations) -> _Failure:
        """Record a failure of `generation` on this rank: its own (this rank's error) or a peer's."""
        from ettr.runtime import get_recorder

        text = f"{type(exc).__name__}: {exc}"
        own = not (_PEER_FAILURE.search(str(exc)) or generations.moved_on(generation))
        rec = get_recorder()
        if own:
            rec.failure(exc)
            rec.flush(timeout_s=2.0)
        logger.warning(  # a peer's failure seen here is not this rank's: the console named the victim
            "ettr: generation %d failed on rank %d (%s); restarting in place"
            if own
            else "ettr: generation %d: rank %d lost a peer (%s); restarting in place",
            generation,
            self.rank,
            text.splitlines()[0][:300],
        )
        exc.__traceback__ = None  # its frames hold the failed generation's objects (and process groups)
        return _Failure(time.time(), time.monotonic(), text[:2000], own)

    def _next(
        self, generations: Generations, generation: int, failure: _Failure | None, error: str, *, own: bool
    ) -> int:
        """Wait for the generation after `generation`, which failed here (`error`; `own`: by this rank's own
        error, not a peer's failure seen through a collective)."""
        begin = time.monotonic()
        try:
            found = generations.after_failure(
                generation,
                rank=self.rank,
                error=error,
                timeout_s=self.config.rendezvous_timeout_s,
                own=own,
            )
        except GenerationTimeout as exc:
            raise InPlaceGaveUp(f"ettr: no in-place restart ({exc}); exiting") from None
        if failure is not None:
            failure.wait_s += time.monotonic() - begin
        self._continue_as(found)
        return found

    def _continue_as(self, generation: int) -> None:
        """Under ettr's agent the next generation is the next attempt: this process's books go on in it."""
        if self.run_env is None or os.environ.get(INPLACE_ENV) != "1":
            return
        from ettr.bootstrap.start import continue_attempt

        continue_attempt(generation)

    def _completed(self, store: dist.Store, generation: int, generations: Generations) -> bool:
        """After `fn` returned here: wait until every rank's returned (True), or a newer generation began
        (False: a peer failed after this rank finished, and the job goes on without the result)."""
        keys = rendezvous.generation_store(store, generation)
        rendezvous.returned(keys, self.rank)
        keys.add("done", 1)
        looked = time.monotonic()
        while int(keys.add("done", 0)) < self.world_size:
            if generations.moved_on(generation):
                return False
            if time.monotonic() - looked >= _DEAD_PEER_LOOK_S:
                # A peer that died while this rank waited here: no collective of this rank fails, and
                # without an agent nobody moves the generation on. In-place SIGKILL trials: 1 of 60 survivors
                # waited here for good (the harness killed it as hung), its peer killed after the recovery.
                looked = time.monotonic()
                dead = rendezvous.dead_peer(keys, self.rank, self.world_size)
                if dead is not None:
                    logger.warning(
                        "ettr: generation %d: rank %d died after this rank finished", generation, dead
                    )
                    return False
            time.sleep(0.005)
        return True


def import_before_first_group() -> None:
    """Import the modules that keep the default process group of the moment they are imported.

    Imported while a generation's group exists, each holds that group for good, so a failed generation's
    connections would never close and the rank gives up in place (`InPlaceGaveUp`):
    - `torch._dynamo`, imported on DistributedDataParallel's first use: ~10 references to the group;
    - `torch.distributed.optim`: ZeroRedundancyOptimizer's `_broadcast_object` has
      `group=dist.group.WORLD` as a default argument, evaluated at import. TorchRec's set-up imports it
      (`_apply_optimizer_in_backward`), so the demo's DLRM gave up in place until it was imported first.
      (Found with `gc.get_referrers` on the group finding nothing: a function's `__defaults__` tuple
      holding only untracked objects is itself untracked by the collector; `gc.get_referents` over
      every tracked object found it.)
    Imported before the first generation forms, they capture no group (None)."""
    for name in IMPORT_BEFORE_FIRST_GROUP:
        importlib.import_module(name)


IMPORT_BEFORE_FIRST_GROUP = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.optim")
"""The modules `import_before_first_group` imports."""


def _stop_underway() -> bool:
    """Whether this process's own SIGTERM handler ran (under `ettr run`: `bootstrap.outside_signals`). An
    exception after it is the stop's consequence, and the process exits with it. Seen with pytorch/examples'
    minGPT-ddp under `ettr run --inject preempt@step=400` (5 December 2026): the forwarded SIGTERM also ended
    the rank's DataLoader workers, torch's SIGCHLD handler raised "DataLoader worker ... is killed by signal:
    Terminated" over the handler's `sys.exit(0)`, the wrapper restarted in place, and the rank waited for a
    next generation until the supervisor's SIGKILL at the end of the grace (10 s)."""
    from ettr.bootstrap.outside_signals import stop_received

    return stop_received()


class InPlaceGaveUp(RuntimeError):
    """A failure could not be recovered in place: the process exits with it (a process restart follows)."""


@dataclass
class _Failure:
    ts: float
    """When this rank saw the failure (Unix time)."""
    monotonic: float
    error: str
    own: bool
    """This rank's own failure (not a peer's seen through a collective)."""
    teardown_s: float = 0.0
    wait_s: float = 0.0


def _record_rejoined(generation: int, failure: _Failure, joined: rendezvous.Joined) -> None:
    """The parts of this rank's in-place restart, as a MARK of the generation it joined."""
    from ettr.runtime import get_recorder

    get_recorder().mark(
        "inplace_restart",
        generation=generation,
        failed_ts=failure.ts,
        own_failure=failure.own,
        teardown_s=round(failure.teardown_s, 6),
        wait_s=round(failure.wait_s, 6),
        rendezvous_s=round(joined.wait_s, 6),
        process_group_s=round(joined.init_s, 6),
        seconds=round(time.monotonic() - failure.monotonic, 6),
    )
