"""Evaluation in train mode: a whole DataLoader pass that runs the trained model with grad disabled and never
learns, recorded as an EVAL span (pytorch/examples' `distributed/minGPT-ddp` runs its test loader through the
training model under `torch.set_grad_enabled(False)`, never calling `model.eval()`: until 2026-12-05 its
per-epoch test pass was booked as the first training step of the next epoch, and the last one as `shutdown`).

  begins   when the pass's iterator is made (`iter(loader)`: a loader's worker processes start there), or at
           the first batch of a loader that keeps its iterator (`persistent_workers`)
  ends     when the iterator is exhausted (the `next` that raises StopIteration: the loop is done with it)
  counts   only when the process learned nothing during the pass (no optimizer step, no backward pass: an epoch
           of training, or gradient accumulation over a whole loader, is training), the first forward pass of
           a trained module in it (one an optimizer trains: `eval_hooks.TrainedModules`) ran with grad
           disabled (a pass that runs no such model, as a statistics pass over the data before the optimizer
           is built, or runs it with grad enabled, is not taken for an evaluation), and no other evaluation was
           recorded in it (the eval-mode hooks of `eval_hooks`, `ettr.phase(EVAL)`, the Lightning and Hugging
           Face integrations: nothing is recorded twice). A pass before the first step counts too (an
           evaluation at iteration 0, and the one a resumed job repeats before it trains), as the eval-mode
           hooks' do.

The first forward pass is seen by a global forward pre-hook that is registered only while a pass waits for
it, and removed at the first forward pass of a trained module: one hook call per epoch of the training loader.
It is not registered once anything was compiled (Dynamo would trace it: the eval hooks' rule), so a compiled
model's passes in train mode are not seen. A pass the loop leaves early (`break` after N batches) is not seen
either: it never ends. Any whole pass of this shape is booked as an evaluation, `swa_utils.update_bn(loader,
model)` on the trained model itself too (docs/supervisor.md). Nothing is recorded until the pass ends, so a pass
cut short by a failure stays in the step around it, as before. Errors are logged once and never reach the
script (`Guard`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ettr import torch_compat
from ettr.bootstrap.eval_hooks import EvalHooks
from ettr.bootstrap.hooks import Guard
from ettr.events import Event, EventKind, Phase
from ettr.patcher import Patcher
from ettr.recorder import RecorderProtocol
from ettr.tracing import dynamo_is_tracing

_PASS_ATTR = "_ettr_loader_pass"
"""The attribute of a DataLoader iterator that holds its pass in progress (`_Pass`)."""

_MADE_ATTR = "_ettr_made_ts"
"""The attribute of a DataLoader iterator that holds when it was made (its worker processes start there)."""


@dataclass(slots=True)
class _Pass:
    """One pass over a DataLoader in progress."""

    begin_ts: float
    num_learned: int  # the process's optimizer steps and backward passes when it began
    num_evals: int  # EVAL phase events recorded in the process when it began
    # The first forward pass of a trained module in it ran with grad disabled (None: not seen yet).
    first_forward_no_grad: bool | None = None


class LoaderPasses:
    """Records the DataLoader passes of one process that are evaluations in train mode (module docstring)."""

    def __init__(self, rec: RecorderProtocol, *, guard: Guard, patcher: Patcher, evals: EvalHooks) -> None:
        self.rec = rec
        self.guard = guard
        self.patcher = patcher
        self.evals = evals
        self.num_learned = 0  # optimizer steps and backward passes of this process so far (`learned`)
        self.num_evals = 0  # EVAL phase events recorded in this process (`on_event`)
        self._awaiting: list[_Pass] = []  # passes waiting for their first forward pass of a trained module
        self._probe: Any = None  # the global forward pre-hook's handle while it is registered
        self._torch: ModuleType | None = None

    def learned(self) -> None:
        """An optimizer step or a backward pass (one increment: called on every step and backward pass)."""
        self.num_learned += 1

    def on_event(self, event: Event) -> None:
        """A recorder listener's share: counts the EVAL phases recorded (by anyone) in this process."""
        if event.phase is Phase.EVAL and event.kind in (EventKind.PHASE_BEGIN, EventKind.PHASE_END):
            self.num_evals += 1

    # -- installation -------------------------------------------------------------------------------------------
    def install(self, torch: ModuleType) -> None:
        """Wrap the DataLoader iterator's `__init__` (when a pass is made) and `__next__` (its batches, its end).
        Installed before the first-batch hook, which puts this `__next__` back after the first batch."""
        self._torch = torch
        base = torch_compat.dataloader_iter_base()
        passes = self

        def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(iterator: Any, *args: Any, **kwargs: Any) -> None:
                iterator.__dict__[_MADE_ATTR] = time.time()
                original(iterator, *args, **kwargs)

            return __init__

        def make_next(original: Callable[..., Any]) -> Callable[..., Any]:
            def __next__(iterator: Any) -> Any:
                if not getattr(iterator, "_num_yielded", 1):  # a pass's first batch
                    passes.guard.call("evaluation", passes._begin, iterator)
                try:
                    return original(iterator)
                except StopIteration:
                    if getattr(iterator, _PASS_ATTR, None) is not None:
                        passes.guard.call("evaluation", passes._end, iterator)
                    raise

            return __next__

        self.patcher.wrap(base, "__init__", make_init)
        self.patcher.wrap(base, "__next__", make_next)
        self.patcher.on_undo(self._unprobe)

    # -- a pass's life ------------------------------------------------------------------------------------------
    def _begin(self, iterator: Any) -> None:
        """The first batch of a pass is asked for: the pass begins (at the iterator's making, where its worker
        processes start, when this is its first pass)."""
        made = iterator.__dict__.pop(_MADE_ATTR, None)
        now = time.time()
        begin_ts = made if made is not None and made <= now else now
        candidate = _Pass(begin_ts=begin_ts, num_learned=self.num_learned, num_evals=self.num_evals)
        setattr(iterator, _PASS_ATTR, candidate)
        if self._probe is None and not self._can_probe():
            return  # the first forward pass cannot be seen: the pass is never taken for an evaluation
        self._awaiting.append(candidate)
        if self._probe is None:
            register = self._torch.nn.modules.module.register_module_forward_pre_hook  # type: ignore[union-attr]
            self._probe = register(self._first_forward)

    def _end(self, iterator: Any) -> None:
        """The pass's iterator is exhausted: record it as an evaluation if it was one."""
        candidate: _Pass = iterator.__dict__.pop(_PASS_ATTR)
        self._forget(candidate)
        if (
            candidate.first_forward_no_grad
            and candidate.num_learned == self.num_learned
            and candidate.num_evals == self.num_evals
            and self.evals.open is None
            and not self.rec.is_open(Phase.EVAL)
        ):
            self.rec.span(Phase.EVAL, candidate.begin_ts, source="zero_code", seen="no_grad_loader_pass")

    def _first_forward(self, module: Any, args: Any) -> None:
        """The global forward pre-hook: the first forward pass of a trained module settles every waiting pass."""
        try:
            if dynamo_is_tracing() or not self._awaiting or not self.evals.trained.trains(module):
                if not self._awaiting:
                    self._unprobe()
                return
            torch = self._torch
            no_grad = torch is not None and not torch.is_grad_enabled()
            for waiting in self._awaiting:
                waiting.first_forward_no_grad = no_grad
            self._awaiting.clear()
            self._unprobe()
        except Exception as exc:
            self.guard.failed("evaluation", exc)

    def _forget(self, candidate: _Pass) -> None:
        self._awaiting = [waiting for waiting in self._awaiting if waiting is not candidate]
        if not self._awaiting:
            self._unprobe()

    def _unprobe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.remove()

    def _can_probe(self) -> bool:
        """Whether a global forward hook runs eagerly: nothing compiled so far, not inside a trace."""
        return (
            self._torch is not None and not dynamo_is_tracing() and torch_compat.dynamo_frames_compiled() == 0
        )
