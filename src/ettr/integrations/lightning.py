"""A PyTorch Lightning `Callback` that records what the Trainer knows exactly.

    from ettr.integrations.lightning import EttrCallback
    trainer = lightning.pytorch.Trainer(..., callbacks=[EttrCallback()])

Under `ettr run` the bootstrap adds one to every Trainer by itself (`install_on`); one added explicitly is
used instead, never a second. Recorded, through the public Recorder API only:

  steps        STEP(trainer.global_step) after each optimizer step (not a count of `optimizer.step` calls:
               gradient accumulation, manual optimization and a resumed loop are all right); the bootstrap's
               own step counting stops
  resume       RESUMED(global step of the restored loops), or RESUMED(None) for a fresh start
  init         the module's `setup` + `configure_model` (model build) and `strategy.setup` (model wrapping,
               optimizers) as TRAIN_MODULE_CREATION; under the bootstrap, `Trainer.__init__` as INIT_PLUGINS
  restore      reading the checkpoint and restoring modules, callbacks, optimizers and loops as RESTORE
  data_wait    the first batch of the first training epoch
  eval         the sanity check and every validation loop as EVAL (open from its start to its end)
  checkpoints  each `trainer.save_checkpoint` as one CHECKPOINT_BLOCKING span (dump + write, every file); one
               CHECKPOINT_COMMIT per checkpoint, from global rank 0 once its file is written; with
               `AsyncCheckpointIO` the blocking span is the hand-off and the write is a CHECKPOINT_PERSIST span
               on the writer thread, committed when it ends
  shutdown     the end of training to the end of teardown (which waits for pending async saves)
  end          the `training_ended` MARK at `on_train_end` (the fit loop ended at `trainer.global_step`: a
               restart that reaches that step is finishing, not stalling; the restart policy's rule 4)

The Trainer's own methods are wrapped on the instance only (never the class), from `setup` until `teardown`.
Importing this module imports Lightning (`lightning.pytorch`, else `pytorch_lightning`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from ettr import inject
from ettr.events import Phase
from ettr.integrations._commits import CheckpointCommits, never_raises, write_save_begin
from ettr.integrations._recorder import default_recorder
from ettr.recorder import RecorderProtocol

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

_FRAMEWORK = "lightning"


class EttrCallback(pl.Callback):
    """Records the Trainer's steps, resume, start-up, evaluation and checkpoints (see the module docstring).

    Args:
        recorder: where to record; by default this process's recorder (`ettr.get_recorder()`).
    """

    def __init__(self, recorder: RecorderProtocol | None = None) -> None:
        super().__init__()
        self._recorder = recorder
        self._undo: list[Callable[[], None]] = []
        self._commits: CheckpointCommits | None = None
        self._last_step: int | None = None
        self._restored = False
        self._first_epoch_ts: float | None = None
        self._eval_phase: Any = None  # the open EVAL phase of a validation loop or the sanity check
        self._train_end_ts: float | None = None
        self._setup_ts: float | None = None

    @property
    def rec(self) -> RecorderProtocol:
        if self._recorder is None:
            self._recorder = default_recorder("the Lightning EttrCallback")
        return self._recorder

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled Trainer carries to the processes `strategy="ddp_spawn"` starts: the settings, not
        this process's recorder (threads, a ledger connection) or its wrappers; each process records to its
        own recorder (`ettr.bootstrap.spawned` made it a rank) and sets up again."""
        state = dict(self.__dict__)
        state.update(_recorder=None, _undo=[], _commits=None, _eval_phase=None)
        return state

    # -- set-up: the instance wrappers ---------------------------------------------------------------------
    @never_raises
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._undo or stage != "fit":
            return
        self._commits = CheckpointCommits(self.rec)
        self._restored, self._last_step, self._first_epoch_ts = False, None, None
        self._setup_ts = time.time()  # the module's own setup and configure_model follow this hook
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is not None:
            self._wrap(connector, "_restore_modules_and_callbacks", self._restoring_modules)
            self._wrap(connector, "restore_training_state", self._restoring_state(connector))
        self._wrap(trainer.strategy, "setup", self._phase_call(Phase.TRAIN_MODULE_CREATION, "strategy_setup"))
        self._wrap(trainer, "save_checkpoint", self._saving(trainer))
        checkpoint_io = trainer.strategy.checkpoint_io
        inner = getattr(checkpoint_io, "checkpoint_io", None)
        if _is_async(checkpoint_io) and inner is not None:
            self._wrap(inner, "save_checkpoint", self._persisting(trainer))

    def _wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        wrapper = functools.wraps(original)(make(original))
        had_own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, wrapper)

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass

        self._undo.append(undo)

    def _model_built(self) -> None:
        """The LightningModule's `setup` and `configure_model` ran from our `setup` hook to now (the
        first restore or the strategy set-up, whichever comes first): the model build, an init sub-stage."""
        begin, self._setup_ts = self._setup_ts, None
        if begin is not None:
            self.rec.span(Phase.TRAIN_MODULE_CREATION, begin, framework=_FRAMEWORK, stage="module_setup")

    def _phase_call(self, phase: Phase, stage: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self._model_built()
                with self.rec.phase(phase, framework=_FRAMEWORK, stage=stage):
                    return original(*args, **kwargs)

            return call

        return make

    def _restoring_modules(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
            self._model_built()
            if not checkpoint_path:
                return original(checkpoint_path, *args, **kwargs)
            with self.rec.phase(
                Phase.RESTORE,
                framework=_FRAMEWORK,
                stage="modules",
                path=str(checkpoint_path),
                source="storage",  # a checkpoint file (or URL): the report's "(restored from)"
            ):
                return original(checkpoint_path, *args, **kwargs)

        return call

    def _restoring_state(self, connector: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                if not getattr(connector, "_loaded_checkpoint", None):
                    return original(*args, **kwargs)
                with self.rec.phase(Phase.RESTORE, framework=_FRAMEWORK, stage="training_state"):
                    return original(*args, **kwargs)

            return call

        return make

    def _saving(self, trainer: pl.Trainer) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
                step = trainer.global_step
                with self.rec.phase(Phase.CHECKPOINT_BLOCKING, step=step, path=str(filepath)):
                    write_save_begin(self.rec)  # on disk before any file: a kill mid-save is then seen
                    inject.checkpoint_in_progress()  # `--inject KIND@checkpoint` fires here, before the write
                    result = original(filepath, *args, **kwargs)
                if not _is_async(trainer.strategy.checkpoint_io):
                    self._committed(trainer, step, filepath)
                return result

            return save_checkpoint

        return make

    def _persisting(self, trainer: pl.Trainer) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_checkpoint(checkpoint: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
                step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
                step = trainer.global_step if not isinstance(step, int) else step
                with self.rec.phase(Phase.CHECKPOINT_PERSIST, step=step, path=str(path)):
                    result = original(checkpoint, path, *args, **kwargs)
                self._committed(trainer, step, path)
                return result

            return save_checkpoint

        return make

    def _committed(self, trainer: pl.Trainer, step: int, path: Any) -> None:
        # Rank 0 writes a Lightning checkpoint (the strategy decides); every rank returns after a barrier.
        if self._commits is not None and trainer.is_global_zero:
            self._commits.committed(step, os.path.abspath(os.fspath(path)))

    # -- hooks -----------------------------------------------------------------------------------------------
    @never_raises
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._restored = True

    @never_raises
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_begin("sanity_check")

    @never_raises
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end()

    @never_raises
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._eval_begin("validation")

    @never_raises
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._eval_end()

    @never_raises
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._eval_end()

    def _eval_begin(self, stage: str) -> None:
        # An open phase (PHASE_BEGIN now): an evaluation cut short by a kill stays on the books, and the
        # bootstrap's own evaluation detection sees it is recorded here.
        self._eval_end()
        phase = self.rec.phase(Phase.EVAL, framework=_FRAMEWORK, stage=stage)
        phase.__enter__()
        self._eval_phase = phase

    def _eval_end(self) -> None:
        phase, self._eval_phase = self._eval_phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    @never_raises
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rec = self.rec
        rec.explicit_steps = True  # the framework's global step from now on; the bootstrap's counting stops
        step = trainer.global_step
        rec.resumed_from(step if self._restored and step > 0 else None)
        self._last_step = step

    @never_raises
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._first_epoch_ts is None:
            self._first_epoch_ts = time.time()

    @never_raises
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_epoch_ts is not None and self._first_epoch_ts > 0:
            self.rec.span(Phase.DATA_WAIT, self._first_epoch_ts, framework=_FRAMEWORK)
            self._first_epoch_ts = 0.0  # done for this fit

    @never_raises
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._last_step:
            self._last_step = step
            self.rec.step(step)

    @never_raises
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_end_ts = time.time()
        self.rec.training_ended(trainer.global_step)  # the fit loop ended: nothing left to train

    @never_raises
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._train_end_ts is not None:
            self.rec.span(Phase.SHUTDOWN, self._train_end_ts, framework=_FRAMEWORK, stage="teardown")
            self._train_end_ts = None
        while self._undo:
            self._undo.pop()()


def _is_async(checkpoint_io: Any) -> bool:
    return any(cls.__name__ == "AsyncCheckpointIO" for cls in type(checkpoint_io).__mro__)


def install_on(trainer: Any, recorder: RecorderProtocol | None = None) -> EttrCallback:
    """Give `trainer` an EttrCallback unless it has one (what the bootstrap calls after `Trainer.__init__`)."""
    for callback in trainer.callbacks:
        if isinstance(callback, EttrCallback):
            return callback
    callback = EttrCallback(recorder)
    # Where a user's own callback would be: after the others, before the checkpoint callbacks (Lightning
    # keeps those last), so that its step mark precedes that step's save as it does when added by hand.
    # An exception raised by a user's callback after the optimizer step ends the process before this one
    # records that step (docs/lightning.md).
    callbacks = trainer.callbacks
    position = next(
        (i for i, c in enumerate(callbacks) if isinstance(c, pl.callbacks.Checkpoint)), len(callbacks)
    )
    callbacks.insert(position, callback)
    return callback
