"""The checkpoint manager: async saves on DCP that block the loop only for a copy, and safe restores.

A save (`save`, or `after_step` when the interval policy says so) waits for the previous save to finish
(recorded as CHECKPOINT_WAIT), then copies the state into staging buffers that are allocated once and
reused (`staging.ReusedStager`: pinned memory where a GPU exists, shared memory for the process mode;
CHECKPOINT_BLOCKING), and returns. By default the copy of the model and optimizer tensors overlaps the
next step's forward and backward, and an optimizer step pre-hook waits for the rest of it (also
CHECKPOINT_BLOCKING). DCP's writers persist the copy in a background thread or process and the
coordinator commits it with a manifest (see `commit`). The persist is recorded as a CHECKPOINT_PERSIST span and, once the manifest
rename is durable, as CHECKPOINT_COMMIT; a failed persist as CHECKPOINT_ERROR, and training goes on.
`restore` loads the newest checkpoint that verifies (RESTORE, then RESUMED).

    state = TrainState(model=model, optimizer=opt, lr_scheduler=sched, data=sampler)
    config = CheckpointConfig(root="ckpt", interval=IntervalConfig.parse("auto"), handle_preemption=True)
    with CheckpointManager(config, state) as ckpt:
        start = ckpt.restore() or 0
        for step in range(start + 1, num_steps + 1):
            train_step()
            ettr.step(step)
            ckpt.after_step(step)      # saves per the policy; on SIGTERM: saves, exits 143
        ckpt.save(num_steps, wait=True)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from ettr.checkpoint.base import (
    CheckpointConfig,
    CheckpointError,
    CheckpointRecorder,
    PersistMode,
    describe_error,
    step_dir_name,
)
from ettr.checkpoint.commit import (
    apply_retention,
    find_latest,
    lease,
    list_checkpoints,
    quarantine,
    verify,
)
from ettr.checkpoint.policy import IntervalPolicy, count_failures
from ettr.checkpoint.preempt import PREEMPTED_EXIT_STATUS, PreemptionWatcher
from ettr.checkpoint.staging import ReusedStager
from ettr.checkpoint.state import TrainState, saved_top_level_keys
from ettr.checkpoint.storage import open_storage
from ettr.checkpoint.writer import make_reader, make_writer
from ettr.events import Phase

logger = logging.getLogger("ettr")


@dataclass
class _Inflight:
    """One save whose persist has started and not yet been accounted for."""

    step: int
    path: str
    begin_ts: float
    done: threading.Event = field(default_factory=threading.Event)
    committed: bool = False


def _default_recorder() -> CheckpointRecorder:
    import ettr

    return ettr.get_recorder()


def _read_job_failures(run_dir: Any) -> tuple[int, float]:
    """(failed attempts so far, job age in seconds) from the job's ledger."""
    from ettr.ledger import read_run_events

    events = read_run_events(run_dir)
    num_failures, first_ts = count_failures(events)
    return num_failures, (time.time() - first_ts) if first_ts is not None else 0.0


class CheckpointManager:
    """Saves and restores one process's `TrainState` (every rank of a job makes one; that is collective).

    Args:
        config: where, how and when to save.
        state: what to save.
        recorder: where phases and commits are recorded (default: `ettr.get_recorder()`).
        process_group: the group to checkpoint over (default: a new gloo group of all ranks, so that the
            background persist never shares a communicator with training collectives).
        clock: monotonic seconds for the interval policy (tests pass a fake).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        state: TrainState,
        *,
        recorder: CheckpointRecorder | None = None,
        process_group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.state = state
        self._rec = recorder if recorder is not None else _default_recorder()
        self._clock = clock
        self._owns_default_group = False
        if config.mode is PersistMode.PROCESS and not dist.is_initialized():
            # DCP's checkpoint process is set up over a process group; a single process gets its own.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._owns_default_group = True
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        self._pg = None
        self._control_pg = None
        if self._distributed:
            self._pg = process_group if process_group is not None else dist.new_group(backend="gloo")
            if self.world_size > 1:
                self._control_pg = dist.new_group(backend="gloo")
        self.storage = open_storage(config.root, config.storage_options)
        # Overlap only where a hook can guard it: the optimizer's step is where the copied tensors change.
        self.overlapping = config.overlap_staging and state.optimizer is not None
        """Whether saves return before the copy of the model and optimizer tensors is complete."""
        self._stager = ReusedStager(
            pin_memory=torch.cuda.is_available(),
            share_memory=config.mode is PersistMode.PROCESS,
            background_keys=OVERLAPPED_KEYS if self.overlapping else (),
        )
        self._staging: tuple[Future[Any], int] | None = None  # the copy still running, and its step
        self._hooks = self._install_staging_hooks() if self.overlapping else []
        self._persist_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ettr-ckpt-persist")
        self.policy = IntervalPolicy(config.interval, now_s=clock(), **self._failure_history())
        self._preemption = PreemptionWatcher().install() if config.handle_preemption else None
        self._inflight: _Inflight | None = None
        self._saving_step = -1
        self.last_committed_step: int | None = None
        """The newest step this manager committed or restored (None: none yet)."""
        self._existing_steps = {c.step for c in list_checkpoints(self.storage)}
        self._warned_earlier_run = False
        self._closed = False

    def _failure_history(self) -> dict[str, Any]:
        """This job's failures so far, for the auto interval (nothing when not auto or without a ledger)."""
        run_dir = getattr(self._rec, "run_dir", None)
        if not self.config.interval.auto or run_dir is None:
            return {}
        try:
            num_failures, job_age_s = _read_job_failures(run_dir)
        except Exception as exc:  # telemetry must not stop training: fall back to the prior alone
            logger.warning(
                "ettr: cannot read the failure history from %s (%s); using the prior", run_dir, exc
            )
            return {}
        return {"num_failures": num_failures, "job_age_s": job_age_s}

    # -- saving -----------------------------------------------------------------------------------------
    def after_step(self, step: int) -> bool:
        """Call at every step boundary (after optimizer step `step`): saves if the interval says so.

        On a pending preemption, saves, waits for the commit, flushes the recorder and raises
        `SystemExit(143)`. Collective when the job has several ranks and the decision depends on time or
        signals (every rank must call it at every step). Returns whether a save was started.
        """
        save_now = self.policy.should_save(step, self._clock())
        preempt = self._preemption is not None and self._preemption.requested
        if self._control_pg is not None and (
            self.policy.config.every_steps is None or self._preemption is not None
        ):
            flags = torch.tensor([int(save_now), int(preempt)], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_pg)
            save_now, preempt = bool(flags[0]), bool(flags[1])
        if preempt:
            self._exit_preempted(step)
        if save_now:
            return self.save(step)
        return False

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
        self._saving_step = step
        name = step_dir_name(step)
        path = self.storage.path(name)
        begin_s = self._clock()
        with self._rec.phase(Phase.CHECKPOINT_BLOCKING, step=step):
            try:
                self._prepare_directory(step)
                state_dict = self.state.state_dict(step, world_size=self.world_size)
                writer = make_writer(
                    self.storage,
                    step,
                    world_size=self.world_size,
                    num_io_threads=self.config.num_io_threads,
                    fault_hook=self.config.fault_hook,
                )
                upload = self._launch(state_dict, writer)
            except Exception as exc:
                logger.warning("ettr: checkpoint of step %d could not start (%s)", step, describe_error(exc))
                self._rec.checkpoint_error(step, path, describe_error(exc))
                return False
        end_s = self._clock()
        self.policy.observe_save(cost_s=(end_s - begin_s) + wait_s, now_s=end_s)
        inflight = _Inflight(step=step, path=path, begin_ts=time.time())
        self._inflight = inflight
        upload.add_done_callback(lambda future: self._on_persisted(inflight, future))
        _checkpoint_in_progress()
        return True

    def _install_staging_hooks(self) -> list[Any]:
        """Wait for an overlapped copy before the first thing that changes the copied tensors."""
        assert self.state.optimizer is not None
        hooks = [self.state.optimizer.register_step_pre_hook(lambda *args: self.wait_staged())]
        if _updates_buffers_in_forward(self.state.model):
            hooks.append(self.state.model.register_forward_pre_hook(lambda *args: self.wait_staged()))
        return hooks

    def wait_staged(self) -> None:
        """Block until the copy of the last save is complete (recorded as CHECKPOINT_BLOCKING if it was not).

        The optimizer step pre-hook calls it; call it yourself before changing model or optimizer tensors
        in place anywhere else between a save and the next optimizer step. Cheap when there is nothing to
        wait for; never raises (a failed copy fails the save's persist, which is recorded).
        """
        pending = self._staging
        if pending is None:
            return
        self._staging = None
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

    def _launch(self, state_dict: dict[str, Any], writer: Any) -> Future[Any]:
        """Copy `state_dict` into the reused staging buffers, then start the persist; returns its future.

        The copy is complete when this returns (the blocking part): the next optimizer step may change the
        tensors in place. Thread mode is DCP's thread-mode async save composed here, so that the persist's
        `dcp.save` is called by ettr (the bootstrap's hooks then leave it to us to record).
        """
        if self.config.mode is PersistMode.PROCESS:
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                async_stager=self._stager,
                process_group=self._pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                no_dist=not self._distributed,
            )
            if isinstance(result, AsyncSaveResponse):  # an overlapped copy: DCP hands it over when done
                self._staging = (result.staging_completion, self._saving_step)
                return result.upload_completion
            return result
        staged = self._stager.stage(state_dict)
        if isinstance(staged, Future):
            self._staging = (staged, self._saving_step)
        return self._persist_executor.submit(self._persist, staged, writer)

    def _persist(self, staged: dict[str, Any] | Future[dict[str, Any]], writer: Any) -> Any:
        """The background persist of thread mode: DCP writes the staged copy; the writer commits."""
        if isinstance(staged, Future):
            staged = staged.result()
        return dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=not self._distributed)

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
            logger.warning(
                "ettr: replacing checkpoint directory %s left by an earlier run", step_dir_name(step)
            )
            self.storage.remove_tree(step_dir_name(step))
        if self._pg is not None and self.world_size > 1:
            dist.barrier(group=self._pg)  # no rank writes before rank 0 has cleared it
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
            self.policy.observe_persist(end_ts - inflight.begin_ts)
            self._rec.span(
                Phase.CHECKPOINT_PERSIST, inflight.begin_ts, end_ts, step=inflight.step, ok=error is None
            )
            if error is None:
                inflight.committed = True
                self.last_committed_step = inflight.step
                if self.rank == 0:
                    self._rec.checkpoint_committed(inflight.step, inflight.path)
                    removed = apply_retention(
                        self.storage,
                        self.config.keep_last,
                        protected_steps=(inflight.step,),
                        lease_ttl_s=self.config.lease_ttl_s,
                    )
                    if removed:
                        logger.info("ettr: retention removed %s", ", ".join(removed))
            else:
                logger.warning(
                    "ettr: checkpoint of step %d failed (%s); training continues from the previous one",
                    inflight.step,
                    describe_error(error),
                )
                self._rec.checkpoint_error(inflight.step, inflight.path, describe_error(error))
                if self.rank == 0:
                    self._discard_failed(inflight.step)
        except Exception as exc:  # pragma: no cover - defensive: never leave waiters hanging
            logger.warning("ettr: accounting for checkpoint %d failed (%s)", inflight.step, exc)
        finally:
            inflight.done.set()

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
        with a warning naming it. Collective. Raises CheckpointError if `step` is given and does not verify.
        """
        self.wait()
        scanning_begin = time.time()
        chosen, existing = self._choose_checkpoint(step)
        self._existing_steps = set(existing)
        self._warned_earlier_run = True
        if chosen is None:
            if step is not None:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.storage.url} is missing or does not verify"
                )
            self._rec.resumed_from(None)
            return None
        name = step_dir_name(chosen)
        with self._rec.phase(Phase.RESTORE, step=chosen):
            with lease(self.storage, name) if self.rank == 0 else contextlib.nullcontext():
                reader = make_reader(self.storage, chosen)
                target = self.state.load_target(saved_top_level_keys(reader.read_metadata()))
                dcp.load(target, storage_reader=reader, process_group=self._pg, no_dist=not self._distributed)
                loaded_step = self.state.load(target)
        if loaded_step != chosen:
            raise CheckpointError(f"{name} holds the state of step {loaded_step}, not {chosen}")
        logger.info(
            "ettr: restored step %d from %s in %.2f s",
            chosen,
            self.storage.path(name),
            time.time() - scanning_begin,
        )
        self.last_committed_step = chosen
        self.policy.reset(self._clock())
        self._rec.resumed_from(chosen)
        return chosen

    def _choose_checkpoint(self, step: int | None) -> tuple[int | None, list[int]]:
        """Rank 0 picks the checkpoint and cleans what cannot be used; every rank learns the result."""
        result: list[Any] = [None, []]
        if self.rank == 0:
            resolution = find_latest(self.storage, checksums=self.config.verify_checksums, at_most=step)
            chosen = resolution.latest.step if resolution.latest is not None else None
            if step is not None and chosen != step:
                chosen = None
            for name, reason in resolution.skipped:
                self._rec.mark("checkpoint_skipped", checkpoint=name, reason=reason)
                if any(c.name == name and c.has_manifest for c in list_checkpoints(self.storage)):
                    moved = quarantine(self.storage, name)
                    logger.warning("ettr: moved corrupt checkpoint %s aside to %s", name, moved)
                else:
                    self.storage.remove_tree(name)
            result = [chosen, [c.step for c in list_checkpoints(self.storage)]]
        if self._pg is not None and self.world_size > 1:
            dist.broadcast_object_list(result, src=0, group=self._pg)
        return result[0], result[1]

    # -- preemption and shutdown ------------------------------------------------------------------------
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
        self._persist_executor.shutdown(wait=True)
        self._stager.close()
        if self._owns_default_group:
            _shutdown_checkpoint_process()
            dist.destroy_process_group()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


OVERLAPPED_KEYS = ("model", "optim")
"""Top-level `TrainState` entries whose copy may overlap the next forward and backward (the optimizer step
pre-hook protects them); the small pickled parts and user `extra` Statefuls are copied at once."""


def _updates_buffers_in_forward(model: torch.nn.Module) -> bool:
    """Whether a forward pass changes the model's buffers (batch norm's running statistics)."""
    from torch.nn.modules.batchnorm import _NormBase

    return any(isinstance(m, _NormBase) and m.track_running_stats for m in model.modules())


def _checkpoint_in_progress() -> None:
    """Tell ettr's fault injector a checkpoint is being written (`--inject KIND@checkpoint`)."""
    from ettr.inject import checkpoint_in_progress

    checkpoint_in_progress()


def _shutdown_checkpoint_process() -> None:
    """Stop DCP's checkpoint process (it is bound to the process group we are about to destroy)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        del process
