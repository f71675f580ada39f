"""The checkpoint manager: async saves on DCP that block the loop only for a copy, and safe restores.

A save (`save`, or `after_step` when the interval policy says so) waits for the previous save to finish
(recorded as CHECKPOINT_WAIT), then copies the state into staging buffers that are allocated once and
reused (`staging.ReusedStager`: pinned memory where a GPU exists, shared memory for the process mode;
CHECKPOINT_BLOCKING), and returns. By default the copy of the model and optimizer tensors overlaps the
next step's forward and backward, and an optimizer step pre-hook waits for the rest of it (also
CHECKPOINT_BLOCKING). DCP's writers persist the copy in a background thread or process and the
coordinator commits it with a manifest (see `commit`). The persist is recorded as a CHECKPOINT_PERSIST span and, once the manifest
rename is durable, as CHECKPOINT_COMMIT; a failed persist as CHECKPOINT_ERROR, and training goes on.
`restore` loads the newest checkpoint that verifies (RESTORE, then RESUMED): its steps are in `restoring.py`
(`Restoring`, this class's base).

The manager orchestrates parts of one concept each: `coordination.Coordinator` (the process groups and
the three collectives), `resume.choose_checkpoint` (which checkpoint to load: pure over storage),
`persist.AsyncPersister` (staging and the background persist), `writer.CommittingWriter` (the commit),
`policy.IntervalPolicy` (when). Its constructor is not collective and reads nothing but the checkpoint
root; `CheckpointManager.create` is the explicit collective step (groups, SIGTERM handler).

    state = TrainState(model=model, optimizer=opt, lr_scheduler=sched, data=sampler)
    config = CheckpointConfig(root="ckpt", interval=IntervalConfig.parse("auto"), handle_preemption=True)
    history = read_failure_history(get_recorder().run_dir)   # the auto interval's ledger read
    with CheckpointManager.create(config, state, failure_history=history) as ckpt:   # collective
        start = ckpt.restore() or 0
        for step in range(start + 1, num_steps + 1):
            train_step()
            ettr.step(step)
            ckpt.after_step(step)      # saves per the policy; on SIGTERM: saves, exits 143
        ckpt.save(num_steps, wait=True)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ettr import memory_sweep
from ettr.checkpoint import root_lock
from ettr.checkpoint.base import (
    CheckpointConfig,
    CheckpointError,
    CheckpointInvalid,
    CheckpointStorage,
    CommittedCheckpoint,
    PersistMode,
    describe_error,
    step_dir_name,
)
from ettr.checkpoint.commit import (
    apply_retention,
    list_checkpoints,
    quarantine,
    root_identity,
    verify,
)
from ettr.checkpoint.coordination import Coordinator, StepAgreement
from ettr.checkpoint.history import FailureHistory
from ettr.checkpoint.keys import KeyRing
from ettr.checkpoint.memory import MemoryCopies, manifest_binding
from ettr.checkpoint.memory_peers import PeerPlan, replicate
from ettr.checkpoint.memory_tier import MemoryTier
from ettr.checkpoint.persist import AsyncPersister, install_staging_hooks, unguarded_changes
from ettr.checkpoint.policy import IntervalPolicy, MemoryIntervalPolicy
from ettr.checkpoint.preempt import PREEMPTED_EXIT_STATUS, PreemptionWatcher
from ettr.checkpoint.restoring import Restoring
from ettr.checkpoint.slowdown_meter import SlowdownMeter
from ettr.checkpoint.snapshot import Binding
from ettr.checkpoint.space import make_room, out_of_space_hint
from ettr.checkpoint.state import TrainState
from ettr.checkpoint.storage import open_storage
from ettr.checkpoint.writer import make_writer
from ettr.constants import COMMIT_FLUSH_S
from ettr.events import Phase
from ettr.recorder import RecorderProtocol
from ettr.run_env import memory_root

logger = logging.getLogger("ettr")


def failure_log_level(error: BaseException, rank: int) -> int:
    """The level a rank logs a failed persist at. DCP hands every rank the same gathered failure (a
    CheckpointException naming each failed rank's cause), so every rank logging it printed each failure once
    per rank (a job of 1,000 ranks, 1,000 identical lines); rank 0 says it, the others log it at INFO (the
    ledger still holds every rank's record). A failure of this rank alone is always a warning."""
    failures = getattr(error, "failures", None)
    gathered = isinstance(failures, dict) and bool(failures)
    return logging.INFO if gathered and rank != 0 else logging.WARNING


@dataclass
class _Inflight:
    """One save whose persist has started and not yet been accounted for."""

    step: int
    path: str
    begin_ts: float
    done: threading.Event = field(default_factory=threading.Event)
    committed: bool = False
    error: str = ""
    piece_crcs: dict[tuple[int, int], int] = field(default_factory=dict)
    """CRC-32s of staged buffers its persist took as it wrote them (thread mode; the memory copy's)."""


def _default_recorder() -> RecorderProtocol:
    from ettr.runtime import get_recorder

    return get_recorder()


class CheckpointManager(Restoring):
    """Saves and restores one process's `TrainState` (every rank of a job makes one).

    The constructor is not collective, creates no process group, reads no ledger and installs no signal
    handler: `create` is the collective step that makes those parts; tests and single processes may pass
    their own. The manager closes the coordinator and the preemption watcher it is given.

    Args:
        config: where, how and when to save.
        state: what to save.
        recorder: where phases and commits are recorded (default: `get_recorder()`).
        coordinator: the ranks and groups (default: a lone process; a job of several ranks, or the
            process persist mode, needs one from `Coordinator.create`, which `create` makes).
        storage: where checkpoints live (default: `open_storage(config.root, config.storage_options)`).
        preemption: the SIGTERM watcher `after_step` acts on (`create` installs one when
            `config.handle_preemption`).
        failure_history: this job's failures so far, for the `auto` interval (`history.read_failure_history`;
            None: the prior alone).
        clock: monotonic seconds for the interval policy (tests pass a fake).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        state: TrainState,
        *,
        recorder: RecorderProtocol | None = None,
        coordinator: Coordinator | None = None,
        storage: CheckpointStorage | None = None,
        preemption: PreemptionWatcher | None = None,
        failure_history: FailureHistory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        coordinator = coordinator if coordinator is not None else Coordinator.single()
        _check_parts(config, coordinator, preemption)
        self.config = config
        self.state = state
        self._rec = recorder if recorder is not None else _default_recorder()
        self._clock = clock
        self._coord = coordinator
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self.storage = storage if storage is not None else open_storage(config.root, config.storage_options)
        self._root = root_identity(self.storage.url)
        self._job_id = config.job_id or self._rec.job_id
        self._root_lock: root_lock.Held | None = None
        self.root_in_use: str | None = None
        """Rank 0: why this root is refused (another running job holds its writer lock); None: it is not."""
        local_root = getattr(self.storage, "root", None)
        if self.rank == 0 and isinstance(local_root, str):
            taken = root_lock.acquire(local_root, job_id=self._job_id, run_dir=self._rec.run_dir)
            if isinstance(taken, str):
                self.root_in_use = taken
            else:
                self._root_lock = taken
        if self.root_in_use is not None and not coordinator.distributed:
            raise CheckpointError(self.root_in_use)
        # Rank 0 signs (it commits) and chooses what to resume from; the other ranks load what it admitted.
        self._ring = KeyRing.open(config.secret, create=True) if self.rank == 0 else KeyRing(signing=None)
        self._root_registered = False
        self._last_error = ""
        # Overlap only where a hook can guard it: the optimizer's step is where the copied tensors change,
        # unless something else changes them (inside backward, before that step; another optimizer). With
        # TorchRec's fused optimizers the overlapped copy of step N took table rows of step N+1: a 2-rank
        # DLRM resumed to another state.
        unguarded = unguarded_changes(state) if config.overlap_staging and state.optimizer else None
        if unguarded is not None:
            logger.info("ettr: saves copy the whole state before they return: %s", unguarded)
        self.overlapping = config.overlap_staging and state.optimizer is not None and unguarded is None
        """Whether saves return before the copy of the model and optimizer tensors is complete."""
        self._persister = AsyncPersister(
            mode=PersistMode(config.mode),
            coordinator=coordinator,
            overlap=self.overlapping,
            pin_memory=torch.cuda.is_available(),
        )
        self._hooks = install_staging_hooks(state, self.wait_staged) if self.overlapping else []
        self._staging_prepared = False
        history = failure_history if config.interval.auto and failure_history is not None else None
        self.policy = IntervalPolicy(
            config.interval,
            now_s=clock(),
            num_failures=history.num_failures if history else 0,
            job_age_s=history.job_age_s if history else 0.0,
        )
        self._meter = SlowdownMeter()  # what persists cost the steps beside them (auto interval)
        self._agreement = StepAgreement(coordinator)
        self._preemption = preemption
        self._inflight: _Inflight | None = None
        self.last_committed_step: int | None = None
        """The newest step this manager committed or restored (None: none yet)."""
        self._existing_steps = {c.step for c in list_checkpoints(self.storage)}
        self._refused_steps: set[int] = set()
        """Intact checkpoints the admission refused (another job's): never deleted by this run."""
        self._warned_earlier_run = False
        self._closed = False
        self._finished = False
        self._memory_source = "memory"
        self._memory_not_used: str | None = None
        """Why the last restore read storage although this rank keeps memory copies (its RESTORE phase's
        `memory_not_used`); None when memory was not tried or no commit exists."""
        self.memory = _memory_copies(config, self.rank, self.storage.url, self._rec.run_dir)
        """This rank's memory copies of the checkpoints (None: `memory_copy=False`, or no shared memory)."""
        if self.memory is not None:  # saves stage into the memory copy's slot, where the stager can
            stager = self._persister.stager
            self.memory.staging_slots = not stager.pin_memory and not stager.share_memory
        self._peers = (
            PeerPlan.from_environ(self.rank, self.world_size, config.memory_replicas)
            if self.memory is not None and coordinator.distributed
            else None
        )
        self.restored_from: str | None = None
        """Where the last `restore` loaded from: "memory" (this rank's copy), "peer" (a copy a rank on
        another node held), "storage" (None: nothing restored)."""
        self.restored_tier: str | None = None
        """"memory" when the last `restore` loaded a memory-tier commit (a step newer than storage's newest,
        `restored_from` "memory"), else None."""
        self._tier = (
            MemoryTier(self.memory)
            if config.memory_interval is not None and self.memory is not None
            else None
        )
        """This rank's memory-tier commits (`memory_tier`; None: `memory_interval` unset, or no memory copies)."""
        self._tier_policy = (
            MemoryIntervalPolicy(
                config.memory_interval,
                now_s=clock(),
                failures_per_day=self.policy.failures_per_train_day,
            )
            if self._tier is not None and config.memory_interval is not None
            else None
        )
        self._lineage: str | None = None
        """This process lifetime's token (rank 0 draws it at each restore): no memory-tier save before it."""
        self._tier_base: Binding | None = None
        """The newest storage commit this process knows (restored or committed): a memory-tier copy's base."""
        self._tier_not_used = ""

    @classmethod
    def create(
        cls,
        config: CheckpointConfig,
        state: TrainState,
        *,
        recorder: RecorderProtocol | None = None,
        process_group: dist.ProcessGroup | None = None,
        failure_history: FailureHistory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> CheckpointManager:
        """Make this rank's manager with its parts. Collective: every rank of the job calls it.

        Makes the checkpoint's gloo groups (`Coordinator.create`: `process_group` to checkpoint over, by
        default a new group of all ranks; a single-rank default group for the process mode in a process
        without torch.distributed) and, with `config.handle_preemption`, installs the SIGTERM handler
        (call from the main thread). `failure_history` is the caller's ledger read for the auto interval.
        """
        coordinator = Coordinator.create(mode=config.mode, process_group=process_group)
        preemption = None
        try:
            preemption = PreemptionWatcher().install() if config.handle_preemption else None
            manager = cls(
                config,
                state,
                recorder=recorder,
                coordinator=coordinator,
                preemption=preemption,
                failure_history=failure_history,
                clock=clock,
            )
        except BaseException:
            if preemption is not None:
                preemption.close()
            coordinator.close()
            raise
        try:  # every rank refuses a root another running job writes, not rank 0 alone (the others would hang)
            (in_use,) = coordinator.broadcast_from_0([manager.root_in_use])
        except BaseException:
            manager.close()
            raise
        if in_use is not None:
            manager.close()
            raise CheckpointError(in_use)
        return manager

    # -- saving -----------------------------------------------------------------------------------------
    def after_step(self, step: int) -> bool:
        """Call at every step boundary (after optimizer step `step`): saves if the interval says so.

        On a pending preemption, saves, waits for the commit, flushes the recorder and raises
        `SystemExit(143)`. Collective when the job has several ranks and the decision depends on time or
        signals (every rank must call it at every step): every rank acts at the same step boundary, within
        two exchanges of the agreement (`StepAgreement`: about half a second of steps, at least the next step)
        of a rank's signal or interval, and no step waits for another rank here. Returns whether a save was started."""
        now_s = self._clock()
        extra_s = self._meter.on_step(now_s, persisting=self.persisting)
        if extra_s is not None:
            self.policy.observe_slowdown(extra_s)
        by_steps = self.policy.config.every_steps is not None
        agreement = self._agreement
        # Time and signals differ between ranks: every rank acts on what any rank proposed, at the same step
        # boundary (a step count's saves are the same on every rank: those are taken at once). This rank's own
        # time decision is made only at an exchange, where it is proposed (below), not at every step.
        # (A memory-tier save is decided by time: agreed like a time-based save even with a step interval.)
        tiered = self.config.memory_interval is not None  # the config, the same on every rank
        agreeing = agreement.collective and (not by_steps or self._preemption is not None or tiered)
        exchange = agreeing and agreement.due()
        if agreeing:
            agreed_save, preempt, memory_now = agreement.take_all() if exchange else (False, False, False)
            save_now = self.policy.should_save(step, now_s) if by_steps else agreed_save
        else:
            save_now = self.policy.should_save(step, now_s)
            preempt = self._preemption is not None and self._preemption.requested
            memory_now = self._memory_tier_due(now_s)
        if preempt:
            self._exit_preempted(step)
        saved = False
        if save_now:
            self._meter.reset()  # the next interval holds the save's blocking and staging wait: not a step
            saved = self.save(step)
            if self._tier_policy is not None:  # the interval runs from the last restore point, of either tier
                self._tier_policy.reset(self._clock())
        elif memory_now:  # never at a step where a storage save starts (the same step on every rank)
            self._save_memory_tier(step)
        if exchange:
            fresh = not by_steps and self.policy.should_save(step, self._clock())  # False right after a save
            requested = self._preemption is not None and self._preemption.requested
            memory = self._memory_tier_due(self._clock())
            agreement.propose(fresh, requested, step_s=self._meter.steady_step_s(), memory=memory)
        return saved

    def _memory_tier_due(self, now_s: float) -> bool:
        """Whether this rank would make a memory-tier save now: on, after a restore, with a storage commit
        to bind it to, and its interval past."""
        return (
            self._tier_policy is not None
            and self._lineage is not None
            and self._tier_base is not None
            and self._tier_policy.should_save(now_s)
        )

    def _save_memory_tier(self, step: int) -> None:
        """Copy the live state of `step` to this rank's memory-tier copy (`memory_tier`), on the caller's
        thread (recorded as CHECKPOINT_BLOCKING with `tier="memory"`). Every rank calls it at the same step;
        a rank that cannot keep one (no storage commit or no restore yet, no room) keeps none, and a restore
        then finds the ranks' copies differ and reads storage. Never raises."""
        tier, tier_policy = self._tier, self._tier_policy
        base, lineage = self._tier_base, self._lineage
        if tier is None or tier_policy is None or base is None or lineage is None:
            return
        self._meter.reset()  # the next interval holds this copy: not a step
        begin_s = self._clock()
        kept = 0
        with self._rec.phase(Phase.CHECKPOINT_BLOCKING, step=step, tier="memory"):
            try:
                state_dict = self.state.state_dict(step, world_size=self.world_size)
                binding = Binding(
                    step=step,
                    manifest_sha256=base.manifest_sha256,
                    world_size=self.world_size,
                    lineage=lineage,
                    base_step=base.step,
                )
                kept = tier.keep(state_dict, binding)
            except Exception as exc:  # never into the loop: the storage commits go on
                logger.warning("ettr: memory-tier copy of step %d failed (%s)", step, describe_error(exc))
                tier.remove()
        end_s = self._clock()
        if tier.made_slot:  # the slot's pages allocated: no measure of what the next ones cost
            tier_policy.reset(end_s)
        else:
            tier_policy.observe(cost_s=end_s - begin_s, now_s=end_s)
        logger.debug("ettr: memory-tier copy of step %d: %d bytes in %.4f s", step, kept, end_s - begin_s)

    def save(self, step: int, *, wait: bool = False) -> bool:
        """Save the state after optimizer step `step`; returns once the state is staged (unless `wait`).

        Waits first for the previous save to finish. Collective: every rank calls it with the same step.
        A step already saved is not saved again. Never raises for a failed save: it is logged and recorded
        as CHECKPOINT_ERROR; returns False then (with `wait`, False also when the persist failed).
        """
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointManager")
        self.wait_staged()
        if step == self.last_committed_step or (self._inflight is not None and self._inflight.step == step):
            return self.wait() if wait else True
        wait_begin_s = self._clock()
        previous = self._inflight
        if previous is not None and not previous.done.is_set():
            with self._rec.phase(Phase.CHECKPOINT_WAIT, step=step):
                previous.done.wait()
        wait_s = self._clock() - wait_begin_s
        started = self._start_save(step, wait_s)
        if not started:
            return False
        return self.wait() if wait else True

    def _start_save(self, step: int, wait_s: float) -> bool:
        name = step_dir_name(step)
        path = self.storage.path(name)
        begin_s = self._clock()
        with self._rec.phase(Phase.CHECKPOINT_BLOCKING, step=step):
            try:
                self._restart_lost_checkpoint_process(step)
                self._prepare_directory(step)
                if self.rank == 0:
                    make_room(
                        self.storage,
                        protected_steps=(step, *self._refused_steps),
                        lease_ttl_s=self.config.lease_ttl_s,
                    )
                state_dict = self.state.state_dict(step, world_size=self.world_size)
                writer = make_writer(
                    self.storage,
                    step,
                    world_size=self.world_size,
                    num_io_threads=self.config.num_io_threads,
                    fault_hook=self.config.fault_hook,
                    secret=self._ring.signing,
                    job_id=self._job_id,
                    raw_tensors=self.config.raw_tensors,
                )
                upload = self._persister.launch(state_dict, writer, step=step)
            except Exception as exc:
                self._last_error = describe_error(exc)
                logger.warning("ettr: checkpoint of step %d could not start (%s)", step, self._last_error)
                self._rec.checkpoint_error(step, path, self._last_error)
                return False
        end_s = self._clock()
        self.policy.observe_save(cost_s=(end_s - begin_s) + wait_s, now_s=end_s)
        inflight = _Inflight(step=step, path=path, begin_ts=time.time(), piece_crcs=writer.sums.pieces)
        self._inflight = inflight
        upload.add_done_callback(lambda future: self._on_persisted(inflight, future))
        _checkpoint_in_progress()
        return True

    def _restart_lost_checkpoint_process(self, step: int) -> None:
        """Process mode: when any rank's DCP checkpoint process has died, every rank lets go of its own (the
        survivors' group is broken too) and this save starts new ones. Without it, one SIGKILLed checkpoint
        process failed every later save of the attempt (EPIPE), and the job trained on without checkpoints.
        One small all-reduce per save, on every rank at the same step, before anything that may fail."""
        if self._persister.mode is not PersistMode.PROCESS:
            return
        (lost,) = self._coord.agree(self._persister.checkpoint_process_lost())
        if lost:
            logger.warning("ettr: a checkpoint process is gone; the save of step %d starts new ones", step)
            self._persister.restart_checkpoint_process()

    def wait_staged(self) -> None:
        """Block until the copy of the last save is complete (recorded as CHECKPOINT_BLOCKING if it was not).

        The optimizer step pre-hook calls it; call it yourself before changing model or optimizer tensors
        in place anywhere else between a save and the next optimizer step. Cheap when there is nothing to
        wait for; never raises (a failed copy fails the save's persist, which is recorded).
        """
        pending = self._persister.pending_staging()
        if pending is None:
            return
        future, step = pending
        if future.done():
            return
        begin_s = self._clock()
        with self._rec.phase(Phase.CHECKPOINT_BLOCKING, step=step, overlapped=True):
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the persist reports it
                pass
        self.policy.add_cost(self._clock() - begin_s)

    def _prepare_directory(self, step: int) -> None:
        """Clear a directory this step would be written into that an earlier run left behind."""
        if not self._warned_earlier_run and self._existing_steps and max(self._existing_steps) > step:
            logger.warning(
                "ettr: %s holds checkpoints up to step %d from an earlier run and this run did not restore(); "
                "a failure would resume from those",
                self.storage.url,
                max(self._existing_steps),
            )
            self._warned_earlier_run = True
        if step not in self._existing_steps:
            return
        if self.rank == 0:
            name = step_dir_name(step)
            if any(c.name == name and c.has_manifest for c in list_checkpoints(self.storage)):
                moved = quarantine(self.storage, name, "replaced")  # committed: someone's data, kept
                logger.warning("ettr: moved checkpoint %s, left by an earlier run, aside to %s", name, moved)
            else:
                logger.warning(
                    "ettr: replacing incomplete checkpoint directory %s left by an earlier run", name
                )
                try:
                    self.storage.remove_tree(name)
                except OSError:  # a tree too deep to delete (planted): moved aside, as a committed one is
                    quarantine(self.storage, name, "replaced")
        self._coord.barrier()  # no rank writes before rank 0 has cleared it
        self._existing_steps.discard(step)

    def _on_persisted(self, inflight: _Inflight, future: Future[Any]) -> None:
        """Runs where the upload completes (a background thread): account for the finished persist."""
        end_ts = time.time()
        error: BaseException | None = None
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - every failure of a persist is recorded, none raised
            error = exc
        try:
            late = error is not None and self.rank == 0 and self._committed_after_all(inflight.step, error)
            if late:  # the manifest is durable: what failed came after it (DCP's closing collective)
                error = None
            self.policy.observe_persist(end_ts - inflight.begin_ts)
            self._rec.span(
                Phase.CHECKPOINT_PERSIST, inflight.begin_ts, end_ts, step=inflight.step, ok=error is None
            )
            if error is None:
                inflight.committed = True
                self.last_committed_step = inflight.step
                if self.rank == 0:
                    self._rec.checkpoint_committed(inflight.step, inflight.path)
                    # in the books now: a SIGKILL within the writer's half second left a durable step that the
                    # next attempt resumed from and the ledger never saw committed (test_checkpoint_faults)
                    self._rec.flush(timeout_s=COMMIT_FLUSH_S)
                    if self._ring.signing is not None and not self._root_registered:
                        self._ring.register_root(self._root)  # from now on, unsigned here is a forgery
                        self._root_registered = True
                    removed = apply_retention(
                        self.storage,
                        self.config.keep_last,
                        protected_steps=(inflight.step, *self._refused_steps),
                        lease_ttl_s=self.config.lease_ttl_s,
                    )
                    if removed:
                        logger.info("ettr: retention removed %s", ", ".join(removed))
                if not late:  # after a late failure the other ranks make no copy: a restore reads storage
                    self._keep_in_memory(inflight.step, inflight.piece_crcs)
            else:
                described = describe_error(error)
                inflight.error = described + out_of_space_hint(self.storage, described)
                logger.log(
                    failure_log_level(error, self.rank),
                    "ettr: checkpoint of step %d failed (%s); training continues from the previous one",
                    inflight.step,
                    inflight.error,
                )
                self._rec.checkpoint_error(inflight.step, inflight.path, inflight.error)
                if self.rank == 0:
                    self._discard_failed(inflight.step)
        except Exception as exc:  # pragma: no cover - defensive: never leave waiters hanging
            logger.warning("ettr: accounting for checkpoint %d failed (%s)", inflight.step, exc)
        finally:
            inflight.done.set()

    def _keep_in_memory(self, step: int, piece_crcs: dict[tuple[int, int], int]) -> None:
        """Write this rank's staged copy of committed `step` to its memory copy (the persist's thread; the
        next save waits for it), with the CRC-32s the persist took of the staged buffers. Never raises."""
        staged = self._persister.stager.last_staged
        if self.memory is None:
            return
        begin_s = time.monotonic()
        binding: Binding | None = None
        try:
            binding = manifest_binding(self.storage, step, self.world_size)
            self._tier_base = binding  # memory-tier copies from now on are made after this commit
        except (OSError, CheckpointInvalid) as exc:
            logger.warning("ettr: no memory copy of step %d: its manifest cannot be read (%s)", step, exc)
            self.memory.discard(self.memory.own_path())
        try:
            kept = self.memory.keep(staged, binding, piece_crcs)
        finally:
            # the next save stages into the memory copy's staging slot (no copy of it after the commit);
            # every view of a slot that is now the committed copy is let go here, whatever keep did
            self._persister.stager.lend(self.memory.staging_views())
        logger.debug(
            "ettr: memory copy of step %d: %d bytes in %.3f s", step, kept, time.monotonic() - begin_s
        )
        if self._peers is not None:  # collective: every rank takes part, with its copy or without one
            try:
                replicate(self._peers, self.memory, binding if kept else None, self._coord.process_group)
            except Exception as exc:
                logger.warning("ettr: peer copies of step %d failed (%s)", step, exc)

    def _committed_after_all(self, step: int, error: BaseException) -> bool:
        """Whether the failed persist of `step` committed before it failed (rank 0). DCP's save ends with a
        collective after the coordinator's `finish` (which commits): a peer that dies then fails the save on
        rank 0 although the manifest is durable, and the next restore resumes from it. Recording that as a
        CHECKPOINT_ERROR would put a resume point in the books that they say never existed. The step's
        directory was cleared before this save wrote into it, so a manifest there is this persist's."""
        try:
            verify(self.storage, step_dir_name(step), checksums=False)
        except (CheckpointError, OSError):
            return False
        logger.warning(
            "ettr: checkpoint of step %d committed; the save failed after its commit (%s)",
            step,
            describe_error(error),
        )
        return True

    def _discard_failed(self, step: int) -> None:
        """Remove what a failed persist left (space on a full disk), unless it committed after all."""
        name = step_dir_name(step)
        try:
            verify(self.storage, name, checksums=False)
            return
        except CheckpointError:
            pass
        except OSError:
            pass
        try:
            self.storage.remove_tree(name)
        except OSError as exc:
            logger.warning("ettr: cannot remove the failed checkpoint %s (%s)", name, exc)

    def finish(self, step: int) -> None:
        """The final save: save `step`, wait for its commit, and raise CheckpointError (so that the job
        exits non-zero) if it did not commit, naming the cause (`ENOSPC (No space left on device)`). Records
        that the training loop has ended at `step` first (`Recorder.training_ended`: the restart policy's
        evidence that a restart reaching `step` is finishing the job; not while an exception is handled)."""
        self._rec.training_ended(step)
        if self.save(step, wait=True):
            self._finished = True
            return
        inflight = self._inflight
        cause = inflight.error if inflight is not None and inflight.step == step else self._last_error
        raise CheckpointError(
            f"the final checkpoint of step {step} in {self.storage.url} failed: {cause or 'unknown cause'}"
        )

    def committed(self, step: int) -> CommittedCheckpoint | None:
        """The checkpoint of `step` if it is the newest this manager committed or restored (else None), for
        a consumer that takes its state from storage instead of writing it again: the publish anchor
        (`ettr.publish.publish_at_end(..., checkpoint=manager.committed(step))`). Call after `finish(step)`
        (or `save(step, wait=True)`); it may be called after `close()`. Not collective."""
        if step != self.last_committed_step or self.persisting:
            return None
        admission = self._admission()
        return CommittedCheckpoint(
            storage=self.storage,
            step=step,
            state_dict=lambda: self.state.state_dict(step, world_size=self.world_size),
            allow_unsigned=admission.allow_unsigned,
            resume_foreign=admission.resume_foreign,
        )

    @property
    def persisting(self) -> bool:
        """Whether a save's background persist is still running."""
        return self._inflight is not None and not self._inflight.done.is_set()

    def request_preemption(self) -> None:
        """Save at the next step boundary and exit with 143, as on SIGTERM (a scheduler's notice that
        arrives another way). Needs `handle_preemption=True`."""
        if self._preemption is None:
            raise CheckpointError("request_preemption() needs CheckpointConfig(handle_preemption=True)")
        self._preemption.request()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight (if any) is committed or failed; returns whether the latest save
        committed (True when none was ever started). Does not record a phase: use it off the hot path."""
        self.wait_staged()
        inflight = self._inflight
        if inflight is None:
            return True
        if not inflight.done.wait(timeout_s):
            return False
        return inflight.committed

    # -- restoring --------------------------------------------------------------------------------------
    def restore(self, step: int | None = None) -> int | None:
        """Load the newest checkpoint that verifies (or exactly `step`); returns its step, None if none.

        Newer checkpoint directories that are incomplete are deleted and corrupt ones moved aside, each
        with a warning naming it. A checkpoint that verifies but fails to load (after retries of
        transient I/O errors) is moved aside with a `checkpoint_skipped` mark and the next older one is
        tried; when none loads, the job starts from scratch with a loud warning. Collective. Raises
        CheckpointError if `step` is given and does not verify or load.

        Then the first save's staging buffers are made on the persist's thread while training starts
        (`_prepare_staging`).
        """
        restored = self._restore(step)
        self._prepare_staging()
        return restored

    def _prepare_staging(self) -> None:
        """Allocate and fault in the staging buffers in the background, once, before the first save: its copy
        otherwise stopped at every page of fresh memory (docs/checkpointing.md, "A save's blocking part").
        The state dict is taken here, on the caller's thread (only its shapes and dtypes are used)."""
        if self._staging_prepared or self._persister.stager.num_bytes:
            return
        self._staging_prepared = True
        try:
            state_dict = self.state.state_dict(0, world_size=self.world_size)
        except Exception as exc:  # the first save says what is wrong with the state, as before
            logger.debug("ettr: staging buffers not made ahead (%s)", describe_error(exc))
            return
        self._persister.prepare(state_dict)

    def _exit_preempted(self, step: int) -> None:
        saved = self.save(step, wait=True)
        self._rec.mark("preempted", step=step, saved=saved)
        logger.warning(
            "ettr: preempted after step %d; checkpoint %s; exiting", step, "committed" if saved else "FAILED"
        )
        self.close()
        self._rec.flush()
        raise SystemExit(PREEMPTED_EXIT_STATUS)

    def close(self) -> None:
        """Wait for the save in flight, then release the staging buffers and the signal handler. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        for hook in self._hooks:
            hook.remove()
        if self._preemption is not None:
            self._preemption.close()
        self._agreement.drain()
        self._persister.close()
        if self.memory is not None:
            self.memory.release_slots()  # the staging slot is never a copy to restore; the copy stays
        if self._tier is not None:
            self._tier.release()
        self._coord.close()
        if self._finished and self._tier is not None:
            self._tier.remove()
        if self._finished and self.memory is not None:
            self.memory.remove_all()  # the job is complete: nothing will restore from it
        if self._root_lock is not None:
            root_lock.release(self._root_lock, str(getattr(self.storage, "root", "")))
            self._root_lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _checkpoint_in_progress() -> None:
    """Tell ettr's fault injector a checkpoint is being written (`--inject KIND@checkpoint`)."""
    from ettr.inject import checkpoint_in_progress

    checkpoint_in_progress()


def _memory_copies(
    config: CheckpointConfig, rank: int, storage_url: str, run_dir: Any
) -> MemoryCopies | None:
    """This rank's memory copies of `config.root` (`ettr.run_env.memory_root`); None when off."""
    if not config.memory_copy:
        return None
    root = memory_root()
    if root is None:
        return None
    memory_sweep.sweep(root)  # copies of jobs that ended without removing theirs (killed, no `ettr run`)
    return MemoryCopies.for_root(
        root, storage_url, rank=rank, owner=run_dir, max_bytes=config.memory_max_bytes
    )


def _check_parts(
    config: CheckpointConfig, coordinator: Coordinator, preemption: PreemptionWatcher | None
) -> None:
    """Refuse a manager whose parts cannot do what its config asks (a silent lone rank of a real job)."""
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if several and coordinator.world_size == 1:
        raise CheckpointError(
            "this job has several ranks: make the manager with CheckpointManager.create(...) (collective), "
            "or pass coordinator=Coordinator.create()"
        )
    if PersistMode(config.mode) is PersistMode.PROCESS and not coordinator.distributed:
        raise CheckpointError(
            "the process persist mode needs a process group: make the manager with "
            "CheckpointManager.create(...), or pass coordinator=Coordinator.create(mode='process')"
        )
    if config.handle_preemption and preemption is None:
        raise CheckpointError(
            "handle_preemption=True needs the SIGTERM handler: make the manager with "
            "CheckpointManager.create(...), or pass preemption=PreemptionWatcher().install()"
        )
