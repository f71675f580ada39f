"""A Hugging Face `TrainerCallback` that records what the `Trainer` knows exactly.

    from ettr.integrations.huggingface import EttrCallback
    trainer = transformers.Trainer(..., callbacks=[EttrCallback()])

Under `ettr run` the bootstrap gives every Trainer one by itself (`install_on`); one added explicitly is used
instead, never a second. Recorded, through the public Recorder API only:

  steps        STEP(state.global_step) at each `on_step_end` (optimizer steps, gradient accumulation
               included); the bootstrap's own step counting stops
  resume       RESUMED(state.global_step restored from `trainer_state.json`), or RESUMED(None)
  restore      loading the model, optimizer, scheduler, scaler and RNG states as RESTORE, and the data
               fast-forward after a mid-epoch resume (the Trainer skips the batches already seen) as RESTORE
  data_wait    the first batch of a run that did not resume mid-epoch
  eval         every `evaluate` as EVAL
  checkpoints  each `_save_checkpoint` (model weights through safetensors, optimizer, scheduler, RNG and
               trainer state: every file) as ONE CHECKPOINT_BLOCKING span and ONE CHECKPOINT_COMMIT of its
               `checkpoint-N` directory, from the process that saves (`args.should_save`)
  end          the `training_ended` MARK at `on_train_end` (the loop ended at `state.global_step`: a restart
               that reaches that step is finishing, not stalling; the restart policy's rule 4)

The callback sees the Trainer itself only when attached (`install_on`, which the bootstrap calls after
`Trainer.__init__`): it then wraps the Trainer's load, save and evaluate methods on the instance. A callback
that was never attached times saves and evaluations from the hooks around them instead (`on_save` and
`on_evaluate` end them; the previous hook began them), and cannot tell model-loading from start-up.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ettr import inject
from ettr.events import Phase
from ettr.integrations._commits import CheckpointCommits, never_raises, write_save_begin
from ettr.integrations._recorder import default_recorder
from ettr.recorder import RecorderProtocol

_FRAMEWORK = "huggingface"
_CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_RESTORE_METHODS = (
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)


class EttrCallback(TrainerCallback):
    """Records the Trainer's steps, resume, restore, evaluation and checkpoints (see the module docstring).

    Args:
        recorder: where to record; by default this process's recorder (`ettr.get_recorder()`).
    """

    def __init__(self, recorder: RecorderProtocol | None = None) -> None:
        self._recorder = recorder
        self._commits: CheckpointCommits | None = None
        self._attached = False
        self._last_step: int | None = None
        self._last_hook_ts: float | None = None
        self._first_epoch_ts: float | None = None
        self._fast_forward = False

    @property
    def rec(self) -> RecorderProtocol:
        if self._recorder is None:
            self._recorder = default_recorder("the Hugging Face EttrCallback")
        return self._recorder

    def __getstate__(self) -> dict[str, Any]:
        """A pickled callback (a Trainer sent to another process) carries no recorder (threads, a ledger
        connection): the other process records to its own."""
        state = dict(self.__dict__)
        state.update(_recorder=None, _commits=None, _attached=False)
        return state

    @property
    def commits(self) -> CheckpointCommits:
        if self._commits is None:
            self._commits = CheckpointCommits(self.rec)
        return self._commits

    # -- attached: the instance wrappers ---------------------------------------------------------------------
    def attach(self, trainer: Any) -> None:
        """Wrap `trainer`'s load, save and evaluate methods on the instance (once; a process keeps them)."""
        if self._attached:
            return
        self._attached = True
        for name in _RESTORE_METHODS:
            self._wrap(trainer, name, self._phase_call(Phase.RESTORE, name.removeprefix("_load_")))
        self._wrap(trainer, "evaluate", self._phase_call(Phase.EVAL, "evaluate"))
        self._wrap(trainer, "_save_checkpoint", self._saving(trainer))

    @staticmethod
    def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, name, None)
        if original is not None:
            setattr(owner, name, functools.wraps(original)(make(original)))

    def _phase_call(self, phase: Phase, stage: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                # The restore methods take the checkpoint directory first: recorded, a report can tell a
                # restore of a checkpoint whose save never completed (`ettr.report.hints`).
                where = args[0] if phase is Phase.RESTORE and args else None
                # A checkpoint directory: the report's "(restored from)" is storage.
                path: dict[str, Any] = (
                    {"path": os.path.abspath(os.fsdecode(where)), "source": "storage"}
                    if isinstance(where, str | os.PathLike)
                    else {}
                )
                with self.rec.phase(phase, framework=_FRAMEWORK, stage=stage, **path):
                    return original(*args, **kwargs)

            return call

        return make

    def _saving(self, trainer: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                step = trainer.state.global_step
                path = _checkpoint_dir(trainer.args, step)
                with self.rec.phase(Phase.CHECKPOINT_BLOCKING, step=step, path=path):
                    write_save_begin(self.rec)  # on disk before any file: a kill mid-save is then seen
                    inject.checkpoint_in_progress()  # `--inject KIND@checkpoint` fires here, before the write
                    result = original(*args, **kwargs)
                if getattr(trainer.args, "should_save", True):
                    self.commits.committed(step, path)
                return result

            return save_checkpoint

        return make

    # -- hooks -----------------------------------------------------------------------------------------------
    @never_raises
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.rec
        rec.explicit_steps = True  # the Trainer's global step from now on; the bootstrap's counting stops
        step = state.global_step
        rec.resumed_from(step if step > 0 else None)
        self._last_step = step
        self._fast_forward = step > 0 and not args.ignore_data_skip and _skips_batches(args, step, kwargs)
        self._first_epoch_ts = None
        self._last_hook_ts = time.time()

    @never_raises
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._first_epoch_ts is None:
            self._first_epoch_ts = time.time()

    @never_raises
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        begin = self._first_epoch_ts
        if begin is not None and begin > 0:
            if self._fast_forward:  # skipping the batches already trained on: recovery, not training
                self.rec.span(Phase.RESTORE, begin, framework=_FRAMEWORK, stage="data_fast_forward")
            else:
                self.rec.span(Phase.DATA_WAIT, begin, framework=_FRAMEWORK)
            self._first_epoch_ts = 0.0

    @never_raises
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step != self._last_step:
            self._last_step = step
            self.rec.step(step)
        self._last_hook_ts = time.time()

    @never_raises
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rec.training_ended(state.global_step)  # the training loop ended: nothing left to train

    @never_raises
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_hook_ts = time.time()

    @never_raises
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._attached and self._last_hook_ts is not None:
            self.rec.span(Phase.EVAL, self._last_hook_ts, framework=_FRAMEWORK, stage="evaluate")
        self._last_hook_ts = time.time()

    @never_raises
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._attached and self._last_hook_ts is not None:
            step, path = state.global_step, _checkpoint_dir(args, state.global_step)
            self.rec.span(Phase.CHECKPOINT_BLOCKING, self._last_hook_ts, step=step, path=path)
            if getattr(args, "should_save", True):
                self.commits.committed(step, path)
        self._last_hook_ts = time.time()


def _checkpoint_dir(args: Any, step: int) -> str:
    return os.path.abspath(os.path.join(args.output_dir, f"{_CHECKPOINT_PREFIX}-{step}"))


def _skips_batches(args: Any, step: int, hook_kwargs: dict[str, Any]) -> bool:
    """Whether a resume at `step` fast-forwards the data (it does unless it resumes at an epoch boundary)."""
    loader = hook_kwargs.get("train_dataloader")
    try:
        num_batches = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return True  # an iterable dataset: the Trainer cannot know where an epoch ends and skips
    per_epoch = max(num_batches // max(args.gradient_accumulation_steps, 1), 1)
    return step % per_epoch != 0


def install_on(trainer: Any, recorder: RecorderProtocol | None = None) -> EttrCallback:
    """Give `trainer` an attached EttrCallback, the user's own if it has one (the bootstrap calls this), first
    among the callbacks: `on_step_end` records the optimizer step before any other callback runs, so one that
    raises or hangs in its own `on_step_end` cannot hide that step (the report's last step and lost steps
    would be one short), and the report is the same wherever the user listed theirs."""
    callbacks = trainer.callback_handler.callbacks
    callback = next((c for c in callbacks if isinstance(c, EttrCallback)), None)
    if callback is None:
        callback = EttrCallback(recorder)
    else:
        callbacks.remove(callback)
    callbacks.insert(0, callback)
    callback.attach(trainer)
    return callback
