"""Evaluation in train mode (`ettr.bootstrap.loader_eval`): a whole DataLoader pass that runs the trained model
with grad disabled and learns nothing is an EVAL span; a pass that learns, runs before training, runs no
trained model or is already an evaluation is not. Hooks installed in this process on a real recorder."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ettr.events import EventKind, Phase
from ettr.recorder import Recorder

torch = pytest.importorskip("torch")


@pytest.fixture
def hooked(in_process_hooks: tuple[Any, Recorder, Any]) -> tuple[Any, Recorder, Any]:
    return in_process_hooks  # tests/conftest.py


def _eval_spans(rec: Recorder, ledger: Any) -> list[tuple[float, float]]:
    rec.flush()
    return [(e.value, e.ts) for e in ledger.read() if e.phase is Phase.EVAL and e.kind is EventKind.PHASE_END]


def _loader(num_batches: int) -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(num_batches * 2, 4), torch.randn(num_batches * 2, 1))
    return torch.utils.data.DataLoader(data, batch_size=2)


def _train_epoch(model: Any, optimizer: Any, loader: Any) -> None:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _model() -> tuple[Any, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_test_pass_in_train_mode_under_disabled_grad_is_an_evaluation(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """pytorch/examples' minGPT-ddp: each epoch trains over the train loader, then runs the test loader through
    the training model (never `eval()`) under `torch.set_grad_enabled(False)`, one block per batch."""
    _, rec, ledger = hooked
    model, optimizer = _model()
    train_loader, test_loader = _loader(4), _loader(3)
    spans = []
    for _ in range(2):
        _train_epoch(model, optimizer, train_loader)
        before = time.time()
        for x, y in test_loader:
            with torch.set_grad_enabled(False):
                torch.nn.functional.mse_loss(model(x), y).item()
        spans.append((before, time.time()))
    recorded = _eval_spans(rec, ledger)
    assert len(recorded) == 2
    for (begin, end), (before, after) in zip(recorded, spans, strict=True):
        assert before <= begin <= end <= after
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the probe is gone between passes


def test_an_evaluation_before_the_first_step_counts_and_a_pass_before_the_optimizer_does_not(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """nanoGPT-style scripts evaluate at iteration 0 (and again right after a resume) before they train; a pass
    over the data before the optimizer is built (statistics, set-up) runs no trained model."""
    _, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    loader = _loader(3)
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    assert _eval_spans(rec, ledger) == []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    assert len(_eval_spans(rec, ledger)) == 1
    _train_epoch(model, optimizer, loader)
    assert len(_eval_spans(rec, ledger)) == 1


def test_passes_that_learn_or_run_no_trained_model_are_not_evaluations(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    _, rec, ledger = hooked
    model, optimizer = _model()
    loader = _loader(3)
    _train_epoch(model, optimizer, loader)
    for x, y in loader:  # gradient accumulation over the whole loader, one step after it: training
        torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    teacher = torch.nn.Linear(4, 1)  # a frozen model nothing trains
    with torch.no_grad():
        for x, _ in loader:
            teacher(x)
    for x, _ in loader:  # forward passes with grad enabled and no backward: not taken for an evaluation
        model(x).sum()
    for x, _ in loader:  # no model at all
        x.sum()
    assert _eval_spans(rec, ledger) == []


def test_an_evaluation_the_eval_mode_hooks_record_is_not_recorded_twice(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    _, rec, ledger = hooked
    model, optimizer = _model()
    loader = _loader(3)
    _train_epoch(model, optimizer, loader)
    model.eval()
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    model.train()
    with rec.phase(Phase.EVAL):  # the script's own (or a framework's) evaluation
        with torch.no_grad():
            for x, _ in loader:
                model(x)
    assert len(_eval_spans(rec, ledger)) == 2


def test_a_pass_left_early_is_not_recorded_and_one_made_beforehand_is(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """A validation that stops after N batches never ends its pass (a limit: not recorded); an iterator
    made beforehand begins where it was made."""
    _, rec, ledger = hooked
    model, optimizer = _model()
    loader = _loader(4)
    _train_epoch(model, optimizer, loader)
    with torch.no_grad():
        for i, (x, _) in enumerate(loader):
            model(x)
            if i == 1:
                break
    assert _eval_spans(rec, ledger) == []
    iterator = iter(loader)
    with torch.no_grad():
        for x, _ in iterator:
            model(x)
    assert len(_eval_spans(rec, ledger)) == 1
