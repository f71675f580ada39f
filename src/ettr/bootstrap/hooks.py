"""The zero-code hooks: what the bootstrap records for a script that never calls ettr.

Installed once torch is imported (see `post_import`), each hook wraps one torch entry point:

  optimizer steps   torch.optim's global step post-hook: STEP(n) with n = resumed step + the number of steps
                    of the optimizer that steps most often (the first to step among optimizers in lockstep:
                    `StepCounter`); stops once user code calls `ettr.step` itself
  backward          torch.autograd.backward (what Tensor.backward calls): the rank's arrival at its step's
                    gradient sync, carried by the next STEP (`Recorder.note_arrival`; slow ranks); in a process
                    that has built no optimizer, each backward pass of the main thread is a step of a loop that
                    updates the weights itself (`p.data.add_(p.grad, alpha=-lr)`, pytorch/examples'
                    word_language_model), recorded once its update is surely done: when the next backward pass
                    begins, an evaluation begins (`eval()`), a checkpoint is saved, or the process exits
  process group     torch.distributed.init_process_group -> PROCESS_GROUP_INIT span
  first batch       the first `__next__` of the first DataLoader iterator -> GET_FIRST_BATCH_DATA span,
                    after which the method it wrapped is put back (`loader_eval`'s: two attribute reads a
                    batch)
  data waits        the DataLoader's wait for its worker processes (`_MultiProcessingDataLoaderIter._get_data`)
                    -> DATA_WAIT span when it lasted `DATA_WAIT_SPAN_MIN_S` or longer (two clock reads a batch)
  child processes   the training thread's wait for a child process between steps (`subprocess.Popen.wait` /
                    `communicate`: `subprocess.run`, an upload after a save) -> OTHER span when it lasted
                    `DATA_WAIT_SPAN_MIN_S` or longer, no phase was open and this process had stepped
  checkpoints       torch.save / torch.load (paths, open files, in-memory buffers written to a file),
                    safetensors' save_file / load_file, dcp.save / dcp.async_save / dcp.load (`checkpoint_hooks`)
  evaluation        `eval()` of a module an optimizer trains -> EVAL span until its `train()` (`eval_hooks`);
                    a whole DataLoader pass, after training began, whose trained model ran with grad disabled
                    and that learned nothing -> EVAL span (`loader_eval`: an evaluation in train mode)
  compile           `ettr.compile.autoinstall(rec)` when that module exists

Every hook is guarded: an error inside one is logged once and the user's call proceeds untouched. The
hooks add a few microseconds to the calls they wrap and nothing to any other.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr import torch_compat
from ettr.events import Event, EventKind, Phase
from ettr.patcher import ORIGINAL_ATTR as _ORIGINAL
from ettr.patcher import Patcher
from ettr.recorder import RecorderProtocol
from ettr.tracing import dynamo_is_tracing
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

DATA_WAIT_SPAN_MIN_S = 1.0
"""A wait of the training thread in a DataLoader for its worker processes' batch that lasts this long or longer
is recorded as a DATA_WAIT span (a new epoch's workers starting, a stalled worker): the books then put it in
`data_wait`, not in the step it delays. Shorter waits stay in their step (no event per batch)."""

JOIN_WATCH: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], None] | None = None
"""Called with (torch's `init_process_group`, args, kwargs) before each call the hooks time, where set: in a
child forked from the instrumented process, `ettr.bootstrap.spawned.watch_forks` sets it so that the child
becomes the rank it joins as (the script calls the hooks' wrapper, which its parent had installed)."""


class Guard:
    """Runs hook code so that its errors are logged once per hook and never reach the user."""

    def __init__(self) -> None:
        self._warn = WarnOnce("ettr: the {what} hook failed ({error}); the call proceeds without it")

    def failed(self, hook: str, exc: BaseException) -> None:
        self._warn(hook, exc)

    def call(self, hook: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failed(hook, exc)
            return None


def called_from_ettr(depth: int = 2) -> bool:
    """Whether the caller `depth` frames up is ettr's own code (which records its own events explicitly)."""
    try:
        name = sys._getframe(depth).f_globals.get("__name__", "")  # noqa: SLF001 - cheap caller check
    except ValueError:
        return False
    return name.startswith("ettr.") and not name.startswith("ettr.bootstrap")


PRIMING_MODULE, PRIMING_FUNCTION = "torch.distributed.checkpoint.state_dict", "_init_optim_state"
"""DCP's priming of a fresh optimizer's state (zero gradients at a zero learning rate, run by `get_state_dict` /
`set_state_dict`, as ettr's checkpoint manager calls them to save and to restore): the optimizer steps inside
it are no training steps. Counted, a process restarted from a checkpoint booked a step 1 during its restore,
before it trained (its start-up read as over, the TTR ending there, the script's steps numbered one up)."""

RPC_OPTIMIZER_MODULE = "torch.distributed.optim.optimizer"
"""`DistributedOptimizer` (torch.distributed.rpc's parameter-server training, pytorch/examples' ddp_rpc): its
`step(context_id)`, called by the training loop, is the step. It steps every owner's local optimizer through
RPC (`_LocalOptimizer.step`, on an RPC thread of the owner, a parameter server or the trainer itself): those
steps are no steps of the owner's loop; and with a functional optimizer (SGD, Adam: `_ScriptLocalOptimizer`,
TorchScript) no `torch.optim` step runs at all. Uncounted, such a job showed no training step (ETT unknown)."""

_uncounted = threading.local()
"""`depth` > 0 while this thread is inside PRIMING_FUNCTION or an RPC-driven local optimizer step
(`RPC_OPTIMIZER_MODULE`): the optimizer steps it makes are no training steps (one wrapper per process:
whichever hooks wrapped it first)."""


def _not_counted(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, with the optimizer steps it makes on this thread left uncounted (`_uncounted`)."""

    def uncounted(*args: Any, **kwargs: Any) -> Any:
        _uncounted.depth = getattr(_uncounted, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _uncounted.depth -= 1

    return uncounted


class StepCounter:
    """Global optimizer steps of an unmodified script: the resumed step plus the steps of the optimizer that
    steps most often, the first one to step when several step in lockstep (a GAN's discriminator and
    generator, pytorch/examples dcgan: one step per iteration, at the first's step).

    Another optimizer that steps twice while the counted one does not step (a critic stepped n times per
    generator step, an optimizer stepped every k-th iteration that happened to step first, an optimizer made
    anew for a second phase, the next fold's model in k-fold cross-validation) is counted from its second such
    step on; its first such step is counted too when it is new or comes back (it had not stepped since before
    the counted one's last two steps: a second phase's optimizer, a fold's optimizer in its next epoch; not the
    partner in lockstep of the counted one's last step, which stepped between its last two), and recorded at
    the takeover. A counted optimizer that was garbage collected gives way to the next one at once. The count
    goes on: steps already recorded keep their numbers."""

    def __init__(self, rec: RecorderProtocol) -> None:
        self._rec = rec
        self._first: weakref.ref[Any] | None = None  # the counted optimizer
        self._since: set[int] = set()  # other optimizers that stepped since the counted one last did
        self._newcomers: set[int] = set()  # of `_since`: new or back after the counted one stepped twice
        # Every optimizer that has stepped -> `num_steps` just after its latest step.
        self._last_stepped: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.base_step = 0
        self.num_steps = 0
        self._manual_pending = False  # a step without an optimizer waits for its update (on_manual_update)
        self._manual_registered = False

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._rec.explicit_steps:
            return
        try:
            # New, or back after the counted one stepped twice without it (k-fold: each fold's optimizer in
            # turn; until 2026-12-05 a returning one's first step was taken for a partner in lockstep and lost:
            # Lightning's kfold_cv example read 75 steps of 80).
            stepped_at = self._last_stepped.get(optimizer)
            returns = self.num_steps >= 2 and (stepped_at is None or self.num_steps - stepped_at >= 2)
        except TypeError:  # an optimizer class with __eq__ and no __hash__: counted as before
            returns = False
        try:
            self._step(optimizer, returns=returns)
        finally:
            try:
                self._last_stepped[optimizer] = self.num_steps
            except TypeError:
                pass

    def _step(self, optimizer: Any, *, returns: bool) -> None:
        counted = self._first() if self._first is not None else None
        if counted is None:  # the first optimizer to step, or the counted one is gone
            self._first = weakref.ref(optimizer)
        elif counted is not optimizer:
            key = id(optimizer)
            if key not in self._since:  # in lockstep so far, or less often than the counted one
                self._since.add(key)
                if returns:
                    self._newcomers.add(key)
                return
            self._first = weakref.ref(optimizer)  # it steps more often than the counted one: count it
            if key in self._newcomers:  # new or back (a second phase, the next fold): its first counts too
                self.num_steps += 1  # booked now, a step late: every number is recorded (crash@step=N fires)
                self._rec.step(self.base_step + self.num_steps, auto=True)
        self._since.clear()
        self._newcomers.clear()
        self.num_steps += 1
        self._rec.step(self.base_step + self.num_steps, auto=True)

    def on_manual_update(self) -> None:
        """A backward pass ended in a process that has built no optimizer: the script updates the weights
        itself, one step per backward pass. Its STEP waits for `settle_manual`, so that the update after the
        backward pass is done when it is recorded (an injected `crash@step=N` fires after update N, as it
        does after `optimizer.step()`); an optimizer that steps later counts on from here."""
        if self._rec.explicit_steps or self._first is not None:
            return
        if not self._manual_registered:
            self._manual_registered = True
            atexit.register(self.settle_manual)  # the last update before the process ends
        self._manual_pending = True

    def settle_manual(self) -> None:
        """The update after the last backward pass is done by now (the next backward pass, an evaluation or a
        save begins, or the process exits): record its STEP. A no-op unless one waits. Never raises."""
        if not self._manual_pending:
            return
        self._manual_pending = False
        try:
            if self._rec.explicit_steps or self._first is not None:
                return
            self.num_steps += 1
            self._rec.step(self.base_step + self.num_steps, auto=True)
        except Exception as exc:  # an atexit callback or a hook: never the user's problem
            logger.debug("ettr: manual step not recorded: %s", exc)

    def new_generation(self) -> None:
        """A restart in place (`ettr.inplace`): the next generation makes its optimizer anew and resumes
        from a checkpoint, so the count starts again from its resume (the earlier optimizer is gone: a
        count kept for it would never move again)."""
        self._first, self.base_step, self.num_steps = None, 0, 0
        self._since.clear()
        self._newcomers.clear()
        self._last_stepped = weakref.WeakKeyDictionary()

    def resumed(self, step: int) -> None:
        """The state was restored as of after `step`: later steps count on from there."""
        self.base_step = step - self.num_steps

    @property
    def current_step(self) -> int:
        """The global step the training state is at now (what a checkpoint saved now holds); a step of a
        loop without an optimizer that waits is recorded first (the save follows its update)."""
        self.settle_manual()
        last = self._rec.last_step
        return last if last is not None else self.base_step + self.num_steps


class AutoHooks:
    """Installs the zero-code hooks for one training process (see the module docstring)."""

    def __init__(self, rec: RecorderProtocol, *, guard: Guard | None = None) -> None:
        self.rec = rec
        self.guard = guard or Guard()
        self.steps = StepCounter(rec)
        self._first_batch_done = False
        self._lock = threading.Lock()
        self.patcher = Patcher()
        self.checkpoints: Any = None
        self.evals: Any = None
        self.loader_passes: Any = None
        # A resume recorded by code that is not hooked (ettr.checkpoint's manager, `ettr.resumed_from`, a
        # framework's callback): the optimizer steps after it count on from its step. Before, a script that
        # restored through CheckpointManager and numbered its steps itself had its first step after the
        # restore recorded as step 1 by the optimizer hook (its own `ettr.step(41)` came after it): the
        # attempt showed one step too many and, without RESUMED, read as resumed from scratch.
        self.guard.call("resume", rec.add_listener, self._on_event)

    def _on_event(self, event: Event) -> None:
        """An event listener: a RESUMED before this generation's first counted step sets where counting
        goes on (a RESUMED of the hooks' own is the same step again); EVAL phases are counted for the loader
        passes (`loader_eval`). Never raises."""
        if event.phase is Phase.EVAL and self.loader_passes is not None:
            self.loader_passes.on_event(event)
        if event.kind is not EventKind.RESUMED or event.step is None:
            return
        if self.steps.num_steps == 0 and not self.rec.explicit_steps:
            self.guard.call("resume", self.steps.resumed, event.step)

    def new_generation(self) -> None:
        """This process goes on in a new generation of a job restarted in place: its steps are counted
        from the generation's resume, which is detected again. Never raises."""
        self.guard.call("optimizer step", self.steps.new_generation)
        if self.checkpoints is not None:
            self.guard.call("torch.save/load", self.checkpoints.new_generation)

    # -- installation (post-import callbacks) -------------------------------------------------------------
    def on_torch(self, torch: ModuleType) -> None:
        """Called once `import torch` finished: install every hook that needs only torch."""
        from ettr.bootstrap.checkpoint_hooks import CheckpointHooks
        from ettr.bootstrap.eval_hooks import EvalHooks
        from ettr.bootstrap.loader_eval import LoaderPasses
        from ettr.constants import IMPORTS_MARK

        self.guard.call("imports", self.rec.mark, IMPORTS_MARK, module="torch")  # the TTR's imports part

        self.checkpoints = CheckpointHooks(self.rec, self.steps, guard=self.guard, patcher=self.patcher)
        self.evals = EvalHooks(self.rec, guard=self.guard, patcher=self.patcher)
        checkpoints, steps = self.checkpoints, self.steps

        def before_eval() -> None:
            checkpoints.training_resumes()  # an evaluation is no part of a save
            steps.settle_manual()  # a step of a loop without an optimizer that waits: recorded before it

        self.evals.before_eval = before_eval
        self.checkpoints.loaded_after_training = self.evals.loaded_after_training
        self.guard.call("optimizer step", self._install_optimizer_hook, torch)
        from ettr.post_import import when_imported

        when_imported(PRIMING_MODULE, self._install_priming_hook)
        when_imported(RPC_OPTIMIZER_MODULE, self._install_rpc_optimizer_hook)
        self.guard.call("evaluation", self.evals.install, torch)
        self.loader_passes = LoaderPasses(self.rec, guard=self.guard, patcher=self.patcher, evals=self.evals)
        # Before the first-batch hook, which wraps this `__next__` and puts it back after the first batch.
        self.guard.call("evaluation", self.loader_passes.install, torch)
        self.guard.call("init_process_group", self._install_process_group_hook, torch)
        from ettr.bootstrap import group_teardown

        self.guard.call("destroy_process_group", group_teardown.install, torch, self.patcher, self.guard)
        self.guard.call("first batch", self._install_first_batch_hook, torch)
        self.guard.call("data wait", self._install_data_wait_hook, torch)
        self.guard.call("child process wait", self._install_child_wait_hook)
        self.guard.call("backward", self._install_backward_hook, torch)
        self.guard.call("torch.save/load", self.checkpoints.install_torch, torch)
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if dcp is not None:
            self.on_dcp(dcp)
        self.guard.call("compile", self._install_compile)

    def on_dcp(self, dcp: ModuleType) -> None:
        """Called once `torch.distributed.checkpoint` is imported."""
        if self.checkpoints is not None:
            self.guard.call("dcp", self.checkpoints.install_dcp, dcp)

    def on_safetensors(self, module: ModuleType) -> None:
        """Called once `safetensors.torch` is imported (its files are checkpoint files too)."""
        if self.checkpoints is not None:
            self.guard.call("safetensors", self.checkpoints.install_safetensors, module)

    def _install_optimizer_hook(self, torch: ModuleType) -> None:
        # `torch.optim` deletes its submodule names; the module itself is imported by then.
        register = importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if getattr(_uncounted, "depth", 0):
                return  # not a training step: DCP gives a fresh optimizer its state, or a peer's RPC steps it
            self._count_step(optimizer, args, kwargs)

        handle = register(after_step)
        self.patcher.on_undo(handle.remove)

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer step of the training loop ended. Never raises (an injected fault still fires)."""
        try:
            if self.loader_passes is not None:
                self.loader_passes.learned()
            self._before_step()
            self.steps.on_step(optimizer, args, kwargs)
        except Exception as exc:
            self.guard.failed("optimizer step", exc)

    def _before_step(self) -> None:
        """What a step (an optimizer's, or a manual update's) settles first: a buffered save or an unplaced
        resume; an evaluation still open (a step in eval mode ends it: training in eval mode)."""
        if self.checkpoints is not None:
            self.checkpoints.before_step()
        if self.evals is not None and self.evals.open is not None:
            self.evals.before_step()

    def _install_rpc_optimizer_hook(self, module: ModuleType) -> None:
        """`DistributedOptimizer.step` counted as the loop's step; `_LocalOptimizer.step`, which a peer's RPC
        runs, not (`RPC_OPTIMIZER_MODULE`)."""
        count = self._count_step

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(optimizer, *args, **kwargs)
                count(optimizer, args, kwargs)
                return result

            return step

        local = getattr(module, "_LocalOptimizer", None)
        if local is not None:
            self.guard.call("rpc optimizer step", self.patcher.wrap, local, "step", _not_counted)
        distributed = getattr(module, "DistributedOptimizer", None)
        if distributed is not None:
            self.guard.call("rpc optimizer step", self.patcher.wrap, distributed, "step", make)

    def _manual_backward(self, *, ended: bool) -> None:
        """A backward pass of the main thread begins or ends, and no optimizer was ever built in this process:
        a loop that updates its weights itself. Its begin settles the previous step (StepCounter.settle_manual),
        its end is a step whose STEP waits (on_manual_update). Never raises (an injected fault still fires)."""
        try:
            evals = self.evals
            if evals is None or evals.trained.num_built or self.rec.explicit_steps:
                return
            if threading.current_thread() is not threading.main_thread():
                return
            if not ended:
                self.steps.settle_manual()
                return
            self._before_step()
            self.steps.on_manual_update()
        except Exception as exc:
            self.guard.failed("backward", exc)

    def _install_priming_hook(self, module: ModuleType) -> None:
        """Leave the optimizer steps inside `PRIMING_FUNCTION` uncounted (its module calls it by its global
        name), at the cost of one thread-local read a step."""
        self.guard.call("dcp priming", self.patcher.wrap, module, PRIMING_FUNCTION, _not_counted)

    def _install_process_group_hook(self, torch: ModuleType) -> None:
        """`init_process_group` timed as PROCESS_GROUP_INIT; `JOIN_WATCH`, where set, sees the call first."""
        dist = torch.distributed
        if not dist.is_available():
            return
        rec, guard = self.rec, self.guard

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                watch = JOIN_WATCH
                if watch is not None:  # a forked child that may become the rank it joins as
                    guard.call("init_process_group", watch, original, args, kwargs)
                if rec.is_open(Phase.PROCESS_GROUP_INIT):  # the script records it itself
                    return original(*args, **kwargs)
                begin = time.time()
                try:
                    return original(*args, **kwargs)
                finally:
                    guard.call("init_process_group", rec.span, Phase.PROCESS_GROUP_INIT, begin)

            return init_process_group

        self.patcher.wrap(dist.distributed_c10d, "init_process_group", make)
        patched = dist.distributed_c10d.init_process_group
        if getattr(dist, "init_process_group", None) is getattr(patched, _ORIGINAL, None):
            self.patcher.set(dist, "init_process_group", patched)

    def _install_backward_hook(self, torch: ModuleType) -> None:
        # Tensor.backward calls torch.autograd.backward through the module attribute: one wrapper sees both.
        note, manual = self.rec.note_arrival, self._manual_backward
        trained = self.evals.trained if self.evals is not None else None
        window = self.checkpoints.window if self.checkpoints is not None else None
        resumes = self.checkpoints.training_resumes if self.checkpoints is not None else None
        learned = self.loader_passes.learned if self.loader_passes is not None else None

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def backward(*args: Any, **kwargs: Any) -> Any:
                if dynamo_is_tracing():
                    return original(*args, **kwargs)
                no_optimizer = trained is not None and not trained.num_built  # one test when there is one
                if window is not None and window.is_open and resumes is not None:
                    resumes()  # a save's window ends where training resumes (`save_window`)
                if no_optimizer:
                    manual(ended=False)  # the previous step's STEP first: it carries its own arrival
                if learned is not None:
                    learned()  # a pass over a loader that runs a backward pass is training (`loader_eval`)
                note()
                result = original(*args, **kwargs)
                if no_optimizer:
                    manual(ended=True)
                return result

            return backward

        self.patcher.wrap(torch.autograd, "backward", make)

    def _install_first_batch_hook(self, torch: ModuleType) -> None:
        base = torch_compat.dataloader_iter_base()  # the one shared __next__
        original = base.__next__
        rec, guard, hooks = self.rec, self.guard, self

        def __next__(self: Any) -> Any:
            # Only the very first batch of the process is timed; then the class gets its method back.
            with hooks._lock:
                first = not hooks._first_batch_done
                if first:
                    hooks._first_batch_done = True
                    if base.__dict__.get("__next__") is __next__:
                        base.__next__ = original
            if not first or rec.is_open(Phase.GET_FIRST_BATCH_DATA) or rec.is_open(Phase.DATA_WAIT):
                return original(self)
            begin = time.time()
            try:
                return original(self)
            finally:
                guard.call("first batch", rec.span, Phase.GET_FIRST_BATCH_DATA, begin)

        functools.update_wrapper(__next__, original)
        self.patcher.set(base, "__next__", __next__)

    def _install_data_wait_hook(self, torch: ModuleType) -> None:
        cls = torch_compat.dataloader_worker_iter()
        if cls is None:
            return
        rec, guard = self.rec, self.guard

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def _get_data(self: Any) -> Any:
                begin = time.time()
                try:
                    return original(self)
                finally:
                    waited = time.time() - begin
                    if waited >= DATA_WAIT_SPAN_MIN_S and not (
                        rec.is_open(Phase.DATA_WAIT) or rec.is_open(Phase.GET_FIRST_BATCH_DATA)
                    ):
                        guard.call("data wait", rec.span, Phase.DATA_WAIT, begin)

            return _get_data

        self.patcher.wrap(cls, "_get_data", make)

    def _install_child_wait_hook(self) -> None:
        import subprocess

        rec, guard, steps = self.rec, self.guard, self.steps
        inside = threading.local()  # communicate() calls wait(): the outer call is the one timed

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def waiting(self: Any, *args: Any, **kwargs: Any) -> Any:
                done = getattr(self, "returncode", None) is not None  # reaped already: nothing to wait for
                if (
                    done
                    or getattr(inside, "busy", False)
                    or threading.current_thread() is not threading.main_thread()
                ):
                    return original(self, *args, **kwargs)
                begin, inside.busy = time.time(), True
                try:
                    return original(self, *args, **kwargs)
                finally:
                    inside.busy = False
                    # Between steps only: a launcher (it never steps) waits for its job; a phase open (a
                    # save, an evaluation, a compile's C++ build) already books its time.
                    if time.time() - begin >= DATA_WAIT_SPAN_MIN_S and steps.num_steps > 0:
                        if not any(rec.is_open(phase) for phase in Phase):
                            guard.call("child process wait", rec.span, Phase.OTHER, begin)

            return waiting

        self.patcher.wrap(subprocess.Popen, "wait", make)
        self.patcher.wrap(subprocess.Popen, "communicate", make)

    def uninstall(self) -> None:
        """Put torch back as it was (tests; a process keeps its hooks to the end)."""
        self.patcher.undo()
        self.guard.call("resume", self.rec.remove_listener, self._on_event)

    def _install_compile(self) -> None:
        try:
            import ettr.compile as compile_support

            install = compile_support.autoinstall
        except (ImportError, AttributeError):
            return  # no compile support in this ettr: nothing to record
        if isinstance(install, ModuleType):  # the submodule, where the package does not re-export it
            install = install.autoinstall
        install(self.rec)
