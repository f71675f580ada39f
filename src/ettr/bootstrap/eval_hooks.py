"""Zero-code evaluation: an unmodified script's evaluation passes, recorded as EVAL phases.

An evaluation is the trained model (a module holding parameters an optimizer trains; in a process without an
optimizer, parameters that a backward pass gave gradients; or a model that a `torch.load` returned whole, or
held in the dict it returned, once the process trained: the best checkpoint loaded back for the final test
pass, `model = torch.load(f)` in pytorch/examples' word_language_model) switched to eval mode,
run forward, and switched back, with no optimizer step in between:

  begins   at `module.eval()` on a trained module (`nn.Module.eval` is wrapped: one call per evaluation,
           never per submodule, never per step; so is every `eval` a module class overrides, found when an
           optimizer is built: Hugging Face's `PreTrainedModel.eval` is `self.train(False)`, which never
           reaches `nn.Module.eval`)
  ends     at `train()` on it (`nn.Module.train` is wrapped only while an evaluation is open, so a script
           that calls `model.train()` every step pays nothing); or, left in eval mode, at the end of its last
           forward pass with grad disabled before the next optimizer step (the step's own forward is
           training); or at the end of its last forward pass when the process exits in eval mode (the final
           validation of a script that never switches back)
  counts   only with a forward pass in between: `eval()` for a save or an export is not an evaluation, nor
           is training in eval mode (forward passes with grad enabled, then an optimizer step; such a module's
           `eval()` is not watched again: BatchNorm layers a fine-tuning script freezes every step)

While an evaluation is open, a forward pre-hook and a forward hook on that module, and on the modules it wraps
(`.module` of DDP, DataParallel, FSDP: a script that switches the wrapper to eval mode may run its passes
through the model inside, `model.module.generate(...)`), and on the model's direct children (a LightningModule's
`test_step` runs `self.model(x)`, never its own forward), time its passes (removed at its end: the training
loop never runs them). They never travel with the module: `nn.Module.__getstate__` is
wrapped while they are on it, so a `torch.save(model)`, a pickle or a `copy.deepcopy` (an EMA) of the module
mid-evaluation holds the script's own hooks only (ettr's hold the recorder, which cannot be pickled). They are left off where Dynamo could trace them (a module
compiled in place, or any module once something was compiled, except `torch.compile`'s own wrapper, which
calls its hooks eagerly): there the evaluation is recorded at its `train()` or at exit, and one that an
optimizer step ends is not recorded (nothing tells it from training in eval mode).

The PHASE_BEGIN (dated at the `eval()` call) is recorded at the first pass with grad disabled, so that an
evaluation cut short by a SIGKILL is still on the books; the PHASE_END at the evaluation's end. An
evaluation inside a phase that user code or a framework callback records itself (`ettr.phase(EVAL)`, the
Lightning and Hugging Face integrations) is theirs: nothing is recorded twice. Errors are logged once and
never reach the script (`Guard`).
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any

from ettr import torch_compat
from ettr.bootstrap.hooks import Guard, Patcher
from ettr.events import EventKind, Phase
from ettr.recorder import RecorderProtocol
from ettr.tracing import dynamo_is_tracing

_DATA = {"source": "zero_code"}
"""`data` of the phases recorded here (the script's own and the frameworks' carry theirs)."""


_MAX_WRAPPED = 4
"""How many wrappers deep `EvalHooks._timed_modules` looks (DDP around FSDP around ... is a few)."""

_MAX_CHILDREN = 32
"""The most direct children of the model whose passes `EvalHooks._timed_modules` times (a model with more is a
container, such as a long `nn.Sequential`, called as a whole: only its own passes are timed)."""


def _among(module: Any, modules: Sequence[Any]) -> bool:
    """Whether `module` is one of `modules` (by identity: a module may define `__eq__`)."""
    return any(module is m for m in modules)


_OWN_PICKLING = frozenset({"__getstate__", "__deepcopy__", "__reduce__", "__reduce_ex__"})
"""What a module class defines when it pickles or copies itself without `nn.Module.__getstate__`."""


def _pickled_by(cls: type, module_class: type) -> bool:
    """Whether `cls` pickles through `module_class.__getstate__` (which leaves ettr's hooks out while an
    evaluation is open): not a class that overrides it without calling it (`nn.LSTM`'s `RNNBase` copies its
    `__dict__` itself: a `torch.save(model)` of a model with an LSTM child would carry the hooks, and fail),
    nor one that copies or reduces itself otherwise (`__deepcopy__`, `__reduce__`, `__reduce_ex__`)."""
    for klass in cls.__mro__:
        if klass is module_class:
            return True
        if not _OWN_PICKLING.isdisjoint(klass.__dict__):
            return False
    return True


def _without_hooks(state: dict[str, Any], handle_ids: set[int]) -> dict[str, Any]:
    """A module's pickled state (a copy of its `__dict__`) without the forward hooks `handle_ids` name."""
    for key in ("_forward_pre_hooks", "_forward_hooks"):
        registered = state.get(key)
        if registered and not handle_ids.isdisjoint(registered):
            state[key] = type(registered)((k, v) for k, v in registered.items() if k not in handle_ids)
    return state


class TrainedModules:
    """Which modules hold parameters that an optimizer trains (optimizers are registered as they are built).
    In a process that has built no optimizer (a loop that updates its weights itself), the modules whose
    parameters hold gradients from a backward pass."""

    def __init__(self) -> None:
        self.num_built = 0  # optimizers built in this process so far
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._key: frozenset[tuple[int, int]] | None = None
        self._param_ids: frozenset[int] = frozenset()
        self._answers: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._loaded: weakref.WeakSet[Any] = weakref.WeakSet()  # models loaded whole after training

    def add(self, optimizer: Any) -> None:
        self.num_built += 1
        self._optimizers.add(optimizer)

    def loaded(self, module: Any) -> None:
        """`module` came out of a checkpoint load after this process trained: it holds trained weights."""
        self._loaded.add(module)

    def _was_loaded(self, module: Any) -> bool:
        """Whether `module` is, or shares a parameter with, a model loaded whole after training."""
        ids = {id(p) for loaded in list(self._loaded) for p in loaded.parameters()}
        return bool(ids) and any(id(p) in ids for p in module.parameters())

    def trains(self, module: Any) -> bool:
        """Whether an optimizer trains any of `module`'s parameters (answers are kept per module until the
        optimizers or their parameter groups change), or it was loaded whole after training."""
        if self._loaded and self._was_loaded(module):
            return True
        if not self.num_built:  # weights updated by hand: what backward passes gave gradients (not kept)
            return any(p.grad is not None for p in module.parameters())
        optimizers = list(self._optimizers)
        key = frozenset((id(o), sum(len(g["params"]) for g in o.param_groups)) for o in optimizers)
        if key != self._key:
            self._key = key
            self._param_ids = frozenset(
                id(p) for o in optimizers for g in o.param_groups for p in g["params"]
            )
            self._answers = weakref.WeakKeyDictionary()
        answer = self._answers.get(module)
        if answer is None:
            ids = self._param_ids
            answer = bool(ids) and any(id(p) in ids for p in module.parameters())
            self._answers[module] = answer
        return answer


@dataclass(slots=True)
class _Evaluation:
    """One evaluation in progress."""

    module: Any
    begin_ts: float
    hooked: bool  # its forward passes are timed (else: only eval() and train() are seen)
    # The modules whose passes are timed: `module`, the modules it wraps, the model's direct children.
    timed: tuple[Any, ...] = ()
    timed_ids: frozenset[int] = frozenset()  # their ids (looked up at every pass)
    handles: list[Any] = field(default_factory=list)
    begun: bool = False  # PHASE_BEGIN recorded
    num_passes: int = 0  # forward passes in eval mode, grad enabled or not
    last_pass_end_ts: float | None = None
    last_no_grad_end_ts: float | None = None


class EvalHooks:
    """Records the evaluation passes of one process (see the module docstring)."""

    def __init__(self, rec: RecorderProtocol, *, guard: Guard, patcher: Patcher) -> None:
        self.rec = rec
        self.guard = guard
        self.patcher = patcher
        self.trained = TrainedModules()
        self.open: _Evaluation | None = None
        # Modules seen training in eval mode (BatchNorm layers a fine-tuning script freezes every step): their
        # eval() is not watched again, so that such a loop pays one set lookup a call, not an evaluation's set-up.
        self._trains_in_eval_mode: weakref.WeakSet[Any] = weakref.WeakSet()
        self._torch: ModuleType | None = None
        # nn.Module attributes wrapped while an evaluation is open: name -> (original, wrapper)
        self._wrapped: dict[str, Callable[[], None]] = {}  # name -> puts nn.Module's own back (Patcher)
        self._atexit = False
        self._seen_classes: weakref.WeakSet[type] = weakref.WeakSet()  # module classes looked at for an eval
        self._make_eval: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
        # Called at every eval() (AutoHooks: a step of a loop without an optimizer is recorded first).
        self.before_eval: Callable[[], None] | None = None

    # -- installation -----------------------------------------------------------------------------------------
    def install(self, torch: ModuleType) -> None:
        """Wrap `Optimizer.__init__` (to know what is trained) and `nn.Module.eval`."""
        self._torch = torch
        hooks = self

        def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
                original(optimizer, *args, **kwargs)
                hooks.guard.call("evaluation", hooks.trained.add, optimizer)
                hooks.guard.call("evaluation", hooks._wrap_eval_overrides)

            return __init__

        def make_eval(original: Callable[..., Any]) -> Callable[..., Any]:
            def eval(module: Any) -> Any:  # noqa: A001 - nn.Module's own name
                result = original(module)
                hooks.guard.call("evaluation", hooks.evaluating, module)
                return result

            return eval

        self._make_eval = make_eval
        self.patcher.wrap(torch.optim.Optimizer, "__init__", make_init)
        self.patcher.wrap(torch.nn.Module, "eval", make_eval)
        self.patcher.on_undo(self._discard)

    def _wrap_eval_overrides(self) -> None:
        """Wrap `eval` of every module class defined so far that overrides it (its own may never call
        `nn.Module.eval`). Run as each optimizer is built; a class seen once is not looked at again."""
        torch, make_eval = self._torch, self._make_eval
        if torch is None or make_eval is None:
            return
        pending: list[type] = list(type.__subclasses__(torch.nn.Module))
        while pending:
            cls = pending.pop()
            if cls in self._seen_classes:
                continue
            self._seen_classes.add(cls)
            pending.extend(type.__subclasses__(cls))
            if isinstance(cls.__dict__.get("eval"), FunctionType):  # not a staticmethod or a property
                self.patcher.wrap(cls, "eval", make_eval)

    def loaded_after_training(self, loaded: Any) -> None:
        """A `torch.load` returned `loaded` after this process trained: a model in it (whole, or a value of
        the dict it returned) holds trained weights, and its `eval()` is an evaluation."""
        torch = self._torch
        if torch is None:
            return
        values = loaded.values() if isinstance(loaded, dict) else (loaded,)
        for value in values:
            if isinstance(value, torch.nn.Module):
                self.trained.loaded(value)

    # -- the evaluation's life ----------------------------------------------------------------------------------
    def evaluating(self, module: Any) -> None:
        """`module.eval()` was called: an evaluation begins if an optimizer trains the module."""
        if self.before_eval is not None:
            self.before_eval()  # a step of a loop without an optimizer that waits: recorded before it
        if self.rec.is_open(Phase.EVAL) or dynamo_is_tracing():
            return
        if self.open is not None:
            # Another trained model switched to eval mode while one is evaluated (the best model loaded back
            # after a validation left the trained one in eval mode, an EMA's pass after the model's): the same
            # evaluation goes on through its passes too.
            evaluation = self.open
            if evaluation.hooked and not _among(module, evaluation.timed) and self.trained.trains(module):
                if self._hookable(module):
                    self._time(evaluation, module)
            return
        if module in self._trains_in_eval_mode or not self.trained.trains(module):
            return
        evaluation = _Evaluation(module=module, begin_ts=time.time(), hooked=self._hookable(module))
        if evaluation.hooked:
            self._time(evaluation, module)
        self.open = evaluation
        self._wrap_while_open()
        if not self._atexit:
            self._atexit = True
            atexit.register(self.guard.call, "evaluation", self.at_exit)

    def _time(self, evaluation: _Evaluation, module: Any) -> None:
        """Time the forward passes of `module` (and the modules it wraps, its direct children) in `evaluation`."""
        added: list[Any] = []
        handles: list[Any] = []
        try:
            added = [m for m in self._timed_modules(module) if not _among(m, evaluation.timed)]
            for timed in added:
                handles.append(timed.register_forward_pre_hook(self._before_pass))
                handles.append(timed.register_forward_hook(self._after_pass))
        except Exception:  # a module that takes no hooks (a scripted one): eval() and train() only
            for handle in handles:
                handle.remove()
            if not evaluation.timed:
                evaluation.hooked = False
            return
        evaluation.timed = (*evaluation.timed, *added)
        evaluation.timed_ids = frozenset(id(timed) for timed in evaluation.timed)
        evaluation.handles.extend(handles)

    def _before_pass(self, module: Any, args: Any) -> None:
        try:
            evaluation = self.open
            if evaluation is None or id(module) not in evaluation.timed_ids:
                return
            evaluation.num_passes += 1
            if evaluation.begun or self._grad_enabled():
                return
            if self.rec.is_open(Phase.EVAL):  # the script or a framework records this evaluation itself
                self._end(None)
                return
            evaluation.begun = True
            self.rec.record(EventKind.PHASE_BEGIN, phase=Phase.EVAL, data=_DATA, ts=evaluation.begin_ts)
        except Exception as exc:
            self.guard.failed("evaluation", exc)

    def _after_pass(self, module: Any, args: Any, output: Any) -> None:
        try:
            evaluation = self.open
            if evaluation is None or id(module) not in evaluation.timed_ids:
                return
            now = time.time()
            evaluation.last_pass_end_ts = now
            if not self._grad_enabled():
                evaluation.last_no_grad_end_ts = now
        except Exception as exc:
            self.guard.failed("evaluation", exc)

    def trained_again(self, module: Any) -> None:
        """`module.train(True)` was called during an evaluation: it ends now if that is the evaluated module
        (or another module with trained parameters, as when the script switches the wrapped model back)."""
        evaluation = self.open
        if evaluation is None:
            return
        if module is evaluation.module or self.trained.trains(module):
            unseen = evaluation.hooked and evaluation.num_passes == 0  # eval() for a save, an export...
            self._end(None if unseen else time.time())

    def before_step(self) -> None:
        """An optimizer step is being counted while the model is in eval mode: the evaluation (its passes with
        grad disabled) ended before this step's forward pass; without them it was training in eval mode."""
        evaluation = self.open
        if evaluation is None:
            return
        if evaluation.hooked and evaluation.num_passes and evaluation.last_no_grad_end_ts is None:
            self._trains_in_eval_mode.add(evaluation.module)
        self._end(evaluation.last_no_grad_end_ts if evaluation.hooked else None)

    def at_exit(self) -> None:
        """The process ends in eval mode (a final validation): the evaluation ends with its last pass."""
        evaluation = self.open
        if evaluation is None:
            return
        self._end(evaluation.last_pass_end_ts if evaluation.hooked else time.time())

    def _end(self, end_ts: float | None) -> None:
        """Close the open evaluation: recorded up to `end_ts`, or dropped (None: it was not one)."""
        evaluation, self.open = self.open, None
        self._unwrap()
        if evaluation is None:
            return
        for handle in evaluation.handles:
            handle.remove()
        if end_ts is None or end_ts <= evaluation.begin_ts:
            if evaluation.begun:  # an empty span: the begin stays paired, nothing is attributed
                end_ts = evaluation.begin_ts
            else:
                return
        if self.rec.is_open(Phase.EVAL) and not evaluation.begun:
            return
        self.rec.record(
            EventKind.PHASE_END, phase=Phase.EVAL, value=evaluation.begin_ts, data=_DATA, ts=end_ts
        )

    def _discard(self) -> None:
        """Uninstalled (tests): forget an open evaluation and put `nn.Module.train` back."""
        evaluation, self.open = self.open, None
        if evaluation is not None:
            for handle in evaluation.handles:
                handle.remove()
        self._unwrap()

    # -- nn.Module.train and __getstate__, wrapped only while an evaluation is open ---------------------------
    def _wrap_while_open(self) -> None:
        """Wrap `train` (to see the evaluation end) and, while its passes are timed, `__getstate__` (so that
        the hooks on the module stay out of its pickles and copies)."""
        torch = self._torch
        if torch is None or self._wrapped:
            return
        hooks = self
        module_class = torch.nn.Module
        original_train = module_class.__dict__["train"]
        original_getstate = module_class.__dict__["__getstate__"]

        def train(module: Any, mode: bool = True) -> Any:
            result = original_train(module, mode)
            if mode and hooks.open is not None:
                hooks.guard.call("evaluation", hooks.trained_again, module)
            return result

        def __getstate__(module: Any) -> Any:
            state = original_getstate(module)
            evaluation = hooks.open
            if evaluation is not None and evaluation.handles and id(module) in evaluation.timed_ids:
                state = _without_hooks(state, {handle.id for handle in evaluation.handles})
            return state

        wrappers: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "train": (original_train, train)
        }
        if self.open is not None and self.open.handles:
            wrappers["__getstate__"] = (original_getstate, __getstate__)
        for name, (original, wrapper) in wrappers.items():
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            wrapper.__doc__ = original.__doc__
            # Put back at the evaluation's end (or the patcher's undo), unless someone wrapped it since.
            self._wrapped[name] = self.patcher.set(module_class, name, wrapper, unless_replaced=True)

    def _unwrap(self) -> None:
        wrapped, self._wrapped = self._wrapped, {}
        for give_back in wrapped.values():
            give_back()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _timed_modules(self, module: Any) -> tuple[Any, ...]:
        """`module`, the modules it wraps (`.module` of DDP, DataParallel, FSDP, DeepSpeed's engine, in
        turn) and the direct children of the innermost (at most `_MAX_CHILDREN` of them). A script that
        switches the wrapper to eval mode often runs its passes through the model inside
        (`model.module.generate(...)`, accelerate's `unwrap_model(model)(batch)`), which the wrapper's hooks
        never see; a framework calls the model's `validation_step`/`test_step`, which runs its submodules,
        never its own forward (a LightningModule's `self.model(x)`: until 2026-12-04 `trainer.test()` after
        `fit` was dropped and booked as shutdown), and so does a script that evaluates `model.encoder(x)`.
        A child whose class pickles itself without `nn.Module.__getstate__` (`nn.LSTM`) is left out, so that
        a `torch.save(model)` mid-evaluation (word_language_model saves its best model in eval mode) never
        carries the hooks.
        A module whose hooks Dynamo could trace (inside torch.compile's wrapper, or once something was
        compiled) is left out."""
        torch = self._torch
        timed = [module]
        inner = getattr(module, "module", None)
        while (
            torch is not None
            and type(timed[-1]).__name__ != "OptimizedModule"  # torch.compile's: what it wraps is traced
            and isinstance(inner, torch.nn.Module)
            and not _among(inner, timed)
            and len(timed) < _MAX_WRAPPED
            and self._hookable(inner)
        ):
            timed.append(inner)
            inner = getattr(inner, "module", None)
        model = timed[-1]
        if torch is not None and type(model).__name__ != "OptimizedModule":  # its child is traced
            children = [child for child in model.children() if not _among(child, timed)]
            if len(children) <= _MAX_CHILDREN:
                timed.extend(
                    child
                    for child in children
                    if _pickled_by(type(child), torch.nn.Module) and self._hookable(child)
                )
        return tuple(timed)

    def _grad_enabled(self) -> bool:
        torch = self._torch
        return bool(torch is not None and torch.is_grad_enabled())

    def _hookable(self, module: Any) -> bool:
        """Whether forward hooks on `module` run eagerly, where Dynamo cannot see them (a hook Dynamo traces
        would change the compiled graph's guards and cost recompiles)."""
        torch = self._torch
        if torch is None:
            return False
        if type(module).__name__ == "OptimizedModule":  # torch.compile's wrapper: its own hooks run eagerly
            return True
        if getattr(module, "_compiled_call_impl", None) is not None:  # compiled in place (Module.compile)
            return False
        if isinstance(module, torch.jit.ScriptModule):
            return False
        compiled = torch_compat.dynamo_frames_compiled()
        return compiled == 0  # nothing compiled so far (None: cannot tell, so not eager)
