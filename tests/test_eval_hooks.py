"""The zero-code evaluation hooks (`ettr.bootstrap.eval_hooks`), installed in this process on a real recorder
and removed again: what counts as an evaluation, where it begins and ends, and what costs nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ettr.events import Event, EventKind, Phase
from ettr.recorder import Recorder

torch = pytest.importorskip("torch")


@pytest.fixture
def hooked(in_process_hooks: tuple[Any, Recorder, Any]) -> tuple[Any, Recorder, Any]:
    return in_process_hooks  # tests/conftest.py


def _evals(rec: Recorder, ledger: Any) -> list[Event]:
    rec.flush()
    return [e for e in ledger.read() if e.phase is Phase.EVAL]


def _spans(events: list[Event]) -> list[tuple[float, float]]:
    return [(e.value, e.ts) for e in events if e.kind is EventKind.PHASE_END]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))

    def forward(self, x: Any) -> Any:
        return self.body(x)


def _train_step(model: Any, optimizer: Any) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _trained_then_validated() -> tuple[Any, Any]:
    """A model trained one step, then switched to eval mode and run once without grad (left in eval mode), and
    its optimizer (kept alive: what it trains is what is evaluated)."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    return model, optimizer


def test_eval_then_train_around_no_grad_passes_is_one_evaluation(hooked: tuple[Any, Recorder, Any]) -> None:
    hooks, rec, ledger = hooked
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    before = time.time()
    model.eval()
    with torch.no_grad():
        first = time.time()
        for _ in range(3):
            model(torch.randn(2, 4))
        last = time.time()
    model.train()
    after = time.time()
    _train_step(model, optimizer)

    events = _evals(rec, ledger)
    assert [e.kind for e in events] == [EventKind.PHASE_BEGIN, EventKind.PHASE_END]
    begin, end = events[0].ts, events[1].ts
    assert events[1].value == begin  # the pair: begin dated at eval(), recorded at the first pass
    assert before <= begin <= first and last <= end <= after
    assert events[0].data == {"source": "zero_code"}
    assert model.training
    assert "__wrapped__" not in vars(torch.nn.Module.train)  # wrapped only while an evaluation is open


def test_what_is_not_an_evaluation(hooked: tuple[Any, Recorder, Any]) -> None:
    hooks, rec, ledger = hooked
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = Net()  # no optimizer trains it
    teacher.eval()
    with torch.no_grad():
        teacher(torch.randn(2, 4))
    assert hooks.evals.open is None
    model.eval()  # for a save: no forward pass
    torch.save(model.state_dict(), Path(rec.run_dir) / "weights.pt")
    model.train()
    model.eval()  # training in eval mode: grad-enabled passes, then an optimizer step
    _train_step(model, optimizer)
    assert hooks.evals.open is None and "__wrapped__" not in vars(torch.nn.Module.train)
    _train_step(model, optimizer)
    with rec.phase(Phase.EVAL):  # the script records it itself: not twice
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        model.train()
    events = _evals(rec, ledger)
    assert [(e.kind, e.data) for e in events] == [(EventKind.PHASE_BEGIN, None), (EventKind.PHASE_END, None)]


def test_a_module_trained_in_eval_mode_is_not_watched_again(hooked: tuple[Any, Recorder, Any]) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = model[1]
    for _ in range(3):  # a fine-tuning loop that freezes its BatchNorm statistics at every step
        model.train()
        norm.eval()
        if _ == 0:
            assert hooks.evals.open is not None  # the first time it looks like an evaluation's start
        else:
            assert hooks.evals.open is None  # then a step showed it trains in eval mode: not watched again
        _train_step(model, optimizer)
    model.eval()  # the whole model is still watched
    assert hooks.evals.open is not None
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    assert len(_spans(_evals(rec, ledger))) == 1


def test_left_in_eval_mode_it_ends_with_its_last_pass_before_the_next_step(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    hooks, rec, ledger = hooked
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()  # a script that never switches back (it trains in eval mode afterwards)
    with torch.no_grad():
        model(torch.randn(2, 4))
        last = time.time()
    between = time.time()
    _train_step(model, optimizer)
    [(begin, end)] = _spans(_evals(rec, ledger))
    assert begin <= end <= last <= between


def test_the_final_evaluation_ends_with_its_last_pass_at_exit(hooked: tuple[Any, Recorder, Any]) -> None:
    hooks, rec, ledger = hooked
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    model.eval()  # like pytorch/examples' mnist: test() switches to eval, the script ends there
    with torch.no_grad():
        model(torch.randn(2, 4))
        last = time.time()
    after = time.time()
    hooks.evals.at_exit()  # what atexit runs (before the recorder's own close)
    [(begin, end)] = _spans(_evals(rec, ledger))
    assert begin <= end <= last <= after
    assert "__wrapped__" not in vars(torch.nn.Module.train)


def test_where_dynamo_could_trace_the_hooks_only_eval_and_train_are_seen(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    hooks, rec, ledger = hooked
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model._compiled_call_impl = model._call_impl  # as Module.compile() leaves it: hooks would be traced
    model.eval()
    assert hooks.evals.open is not None and not hooks.evals.open.hooked
    assert not model._forward_hooks and not model._forward_pre_hooks
    with torch.no_grad():
        model(torch.randn(2, 4))
    before_train = time.time()
    model.train()
    after_train = time.time()
    model.eval()
    _train_step(model, optimizer)  # a step ends it: evaluation or training in eval mode? Not recorded.
    [(begin, end)] = _spans(_evals(rec, ledger))
    assert begin <= before_train <= end <= after_train


def test_the_trained_set_follows_the_optimizers_parameter_groups() -> None:
    from ettr.bootstrap.eval_hooks import TrainedModules

    trained = TrainedModules()
    head, body = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    trained.add(optimizer)
    assert trained.trains(head) and not trained.trains(body)
    optimizer.add_param_group({"params": body.parameters()})  # unfrozen later: now trained too
    assert trained.trains(body)
    assert not trained.trains(torch.nn.ReLU())  # no parameters


def test_a_whole_module_saved_or_copied_during_an_evaluation_carries_no_hooks(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    """Scripts save the whole model (`torch.save(model)`) or copy it (`copy.deepcopy`, an EMA) after a
    validation, often still in eval mode: ettr's hooks on it must not travel (they hold the recorder, which
    cannot be pickled), and the evaluation goes on being timed."""
    import copy
    import pickle

    hooks, rec, ledger = hooked
    model, _optimizer = _trained_then_validated()
    assert model._forward_pre_hooks and model._forward_hooks  # the evaluation is being timed
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    twin = copy.deepcopy(model)
    pickled = pickle.loads(pickle.dumps(model))
    for other in (loaded, twin, pickled):
        assert not other._forward_pre_hooks and not other._forward_hooks
        assert not other.training
        assert torch.equal(other.body[0].weight, model.body[0].weight)
    assert model._forward_pre_hooks and model._forward_hooks  # still timed: the copies took nothing away
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    assert len(_spans(_evals(rec, ledger))) == 1
    assert not model._forward_pre_hooks and not model._forward_hooks
    # A module with hooks of its own keeps them in its copies; only ettr's are left out.
    model.register_forward_hook(_user_hook)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    copied = copy.deepcopy(model)
    assert list(copied._forward_hooks.values()) == [_user_hook] and not copied._forward_pre_hooks
    model.train()


def _user_hook(module: Any, args: Any, output: Any) -> None:
    return None


class PretrainedLike(torch.nn.Module):
    """Hugging Face's PreTrainedModel (transformers 5): its eval() is `self.train(False)`, never nn.Module.eval."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 1)

    def eval(self) -> PretrainedLike:  # type: ignore[override]
        return self.train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_an_eval_a_model_class_overrides_is_an_evaluation(hooked: tuple[Any, Recorder, Any]) -> None:
    # A custom loop over a transformers model: 19.4 s of model.eval() passes were booked as training.
    hooks, rec, ledger = hooked
    model = PretrainedLike()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # finds PretrainedLike.eval and wraps it
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    events = _evals(rec, ledger)
    assert [e.kind for e in events] == [EventKind.PHASE_BEGIN, EventKind.PHASE_END]
    assert "__wrapped__" not in vars(torch.nn.Module.train)  # train() still costs nothing outside evaluations
    hooks.uninstall()
    assert "eval" in PretrainedLike.__dict__ and not hasattr(PretrainedLike.__dict__["eval"], "__wrapped__")


class Wrapper(torch.nn.Module):
    """What DistributedDataParallel, DataParallel and FSDP look like here: the model under `.module`."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Any:
        return self.module(x)


def test_passes_through_the_model_inside_a_wrapper_switched_to_eval_are_an_evaluation(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """`model.eval()` on the DDP wrapper, then passes through `model.module` (`model.module.generate(...)`,
    accelerate's `unwrap_model(model)`): until 2026-12-04 no pass was seen, the evaluation was dropped at
    `train()` and its time booked as training."""
    import pickle

    hooks, rec, ledger = hooked
    model = Wrapper(Wrapper(Net()))  # DDP around a wrapper of its own, each with its `.module`
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    before = time.time()
    model.eval()
    with torch.no_grad():
        first = time.time()
        model.module.module(torch.randn(2, 4))
        model.module(torch.randn(2, 4))
        last = time.time()
    copied = pickle.loads(pickle.dumps(model))  # none of ettr's hooks travel, from any level
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in copied.modules())
    model.train()
    after = time.time()
    _train_step(model, optimizer)
    ((begin, end),) = _spans(_evals(rec, ledger))
    assert before <= begin <= first and last <= end <= after
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    # Left in eval mode: ended by the last pass through the inner model, before the next step.
    model.eval()
    with torch.no_grad():
        model.module.module(torch.randn(2, 4))
        last = time.time()
    _train_step(model, optimizer)
    assert _spans(_evals(rec, ledger))[1][1] <= last


class StepModule(torch.nn.Module):
    """What a LightningModule looks like to the hooks: the framework calls `test_step`, which runs the model's
    submodule, never the module's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def test_step(self, x: Any) -> Any:
        return self.model(x)


def test_passes_through_a_submodule_of_the_evaluated_module_are_an_evaluation(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """`trainer.test()` after `fit` on a LightningModule whose `test_step` calls `self.model(x)` (Lightning's
    own examples/pytorch/basics/transformer.py): until 2026-12-04 no pass was seen, the evaluation was
    dropped and its time booked as the job's shutdown."""
    hooks, rec, ledger = hooked
    module = StepModule()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    _train_step(module.model, optimizer)
    before = time.time()
    module.eval()
    with torch.inference_mode():  # what Lightning's evaluation loops run under
        first = time.time()
        for _ in range(3):
            module.test_step(torch.randn(2, 4))
        last = time.time()
    hooks.evals.at_exit()  # the process ends in eval mode after trainer.test()
    ((begin, end),) = _spans(_evals(rec, ledger))
    assert before <= begin <= first and last >= end >= first
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in module.modules())


class WithLSTM(torch.nn.Module):
    """pytorch/examples' word_language_model: an LSTM child, whose class pickles itself (`RNNBase.__getstate__`)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(10, 4)
        self.rnn = torch.nn.LSTM(4, 4)
        self.decoder = torch.nn.Linear(4, 10)

    def forward(self, x: Any) -> Any:
        return self.decoder(self.rnn(self.encoder(x))[0])


def test_a_model_with_a_child_that_pickles_itself_is_saved_whole_mid_evaluation(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    """word_language_model evaluates (left in eval mode) and then `torch.save(model, f)`: hooks on its LSTM
    child would travel with it (the recorder's lock: `cannot pickle '_thread.lock' object`)."""
    import io

    hooks, rec, ledger = hooked
    model = WithLSTM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 10, (3, 2))).sum().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 10, (3, 2)))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # mid-evaluation: the hooks are still on the model
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in loaded.modules())
    model.train()
    assert len(_spans(_evals(rec, ledger))) == 1


def test_only_children_that_pickle_through_nn_module_are_timed() -> None:
    from ettr.bootstrap.eval_hooks import _pickled_by

    class CopiesItself(torch.nn.Linear):
        def __deepcopy__(self, memo: Any) -> Any:
            return self

    assert _pickled_by(torch.nn.Linear, torch.nn.Module)
    assert _pickled_by(Net, torch.nn.Module)
    assert not _pickled_by(torch.nn.LSTM, torch.nn.Module)
    assert not _pickled_by(CopiesItself, torch.nn.Module)


def test_a_model_loaded_whole_after_training_is_evaluated(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    """pytorch/examples' word_language_model saves the whole model at its best validation, and after training
    loads it back (`model = torch.load(f)`, a new module no optimizer trains, with no gradients) for its final
    test pass: that pass is an evaluation (it was booked `shutdown`). A model loaded before training (a
    teacher, pretrained weights) is not made trained by it."""
    hooks, rec, ledger = hooked
    teacher_path = tmp_path / "teacher.pt"
    torch.save(Net(), teacher_path)
    teacher = torch.load(teacher_path, weights_only=False)  # before any step
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    _train_step(model, optimizer)
    teacher.eval()
    with torch.no_grad():
        teacher(torch.randn(2, 4))
    assert hooks.evals.open is None
    with open(tmp_path / "model.pt", "wb") as f:
        torch.save(model, f)
    _train_step(model, optimizer)
    with open(tmp_path / "model.pt", "rb") as f:
        best = torch.load(f, weights_only=False)
    packed_path = tmp_path / "packed.pt"
    torch.save({"model": Net(), "step": 3}, packed_path)
    packed = torch.load(packed_path, weights_only=False)["model"]
    for loaded in (best, packed):
        loaded.eval()
        with torch.no_grad():
            loaded(torch.randn(2, 4))
        loaded.train()
    assert len(_spans(_evals(rec, ledger))) == 2


def test_a_model_loaded_whole_while_the_trained_one_is_in_eval_mode_is_timed_too(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    """word_language_model's last epoch: its validation leaves the model in eval mode, saves it whole, and the
    loaded copy's test pass follows with no `train()` between: the evaluation goes on through the copy's passes
    (the copy was not timed, and its pass was booked `shutdown`)."""
    hooks, rec, ledger = hooked
    model, _optimizer = _trained_then_validated()
    torch.save(model, tmp_path / "best.pt")
    best = torch.load(tmp_path / "best.pt", weights_only=False)
    before_its_pass = time.time()
    best.eval()
    with torch.no_grad():
        best(torch.randn(2, 4))
    hooks.evals.at_exit()
    spans = _spans(_evals(rec, ledger))
    assert len(spans) == 1 and spans[0][1] > before_its_pass  # it ends with the copy's pass
    assert not best._forward_pre_hooks and not best._forward_hooks and not model._forward_hooks
