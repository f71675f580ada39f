"""Fast batches and parallel start-up: specs, synthesis, and overlap of compile, data and checkpoint read."""

from __future__ import annotations

import json
import logging
import threading

import pytest

torch = pytest.importorskip("torch")

from ettr.compile import fastbatch  # noqa: E402
from ettr.compile.fastbatch import TensorSpec  # noqa: E402
from ettr.compile.startup import fast_start, warm_up  # noqa: E402
from ettr.events import EventKind, Phase  # noqa: E402
from ettr.ledger import MemoryLedger  # noqa: E402
from ettr.recorder import Recorder  # noqa: E402

_WAIT_S = 30.0  # generous: only reached when the overlap is broken, and then the test fails, not hangs


def _batch():
    return {
        "ids": torch.tensor([[3, 9], [0, 7]], dtype=torch.int64),
        "x": torch.full((2, 5), 0.5),
        "mask": torch.tensor([True, False]),
        "meta": (torch.zeros(3, dtype=torch.float16), 7),
    }


def test_spec_of_a_batch_records_structure_shapes_dtypes_and_ranges():
    spec = fastbatch.spec_of(_batch())
    assert spec["ids"] == TensorSpec(shape=(2, 2), dtype="int64", low=0.0, high=9.0)
    assert spec["x"].shape == (2, 5) and spec["x"].dtype == "float32"
    assert isinstance(spec["meta"], tuple) and spec["meta"][1] == 7


def test_synthesized_batches_match_the_spec_and_are_deterministic():
    spec = fastbatch.spec_of(_batch())
    fake = fastbatch.synthesize(spec, seed=1)
    assert fake["ids"].dtype == torch.int64 and fake["ids"].shape == (2, 2)
    assert int(fake["ids"].min()) >= 0 and int(fake["ids"].max()) <= 9
    assert fake["mask"].dtype == torch.bool and fake["meta"][0].dtype == torch.float16
    assert fake["meta"][1] == 7
    assert torch.equal(fastbatch.synthesize(spec, seed=1)["x"], fake["x"])


def test_specs_round_trip_through_json(tmp_path):
    spec = fastbatch.spec_of(_batch())
    path = fastbatch.job_file(tmp_path)
    fastbatch.save_spec(path, spec)
    assert fastbatch.load_spec(path) == spec
    path.write_text('{"schema": "other"}')
    assert fastbatch.load_spec(path) is None


def test_tensor_spec_is_validated():
    with pytest.raises(ValueError, match="high"):
        TensorSpec(shape=(1,), dtype="float32", low=1.0, high=0.0)
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec(shape=(1,), dtype="torch.float32")
    with pytest.raises(ValueError, match="shape"):
        TensorSpec(shape=(-1,), dtype="float32")


def _recorder(tmp_path):
    rec = Recorder(MemoryLedger(), run_dir=tmp_path, flush_interval_s=60)
    return rec


def test_fast_start_overlaps_compile_data_and_restore(tmp_path):
    """Each part waits until the other two have started: run one after another, this would time out."""
    rec = _recorder(tmp_path)
    started = {name: threading.Event() for name in ("compile", "data", "restore")}

    def all_started(me: str) -> None:
        started[me].set()
        for name, event in started.items():
            assert event.wait(_WAIT_S), f"{me} ran without {name} running beside it"

    seen = []

    def warmup(batch):
        seen.append(batch)
        all_started("compile")

    def first_batch():
        all_started("data")
        return {"x": torch.ones(4, 3)}

    def restore():
        all_started("restore")
        return {"step": 7}

    spec = {"x": TensorSpec(shape=(4, 3), dtype="float32")}
    result = fast_start(warmup, first_batch, restore=restore, spec=spec, rec=rec)
    assert result.restored == {"step": 7} and torch.equal(result.first_batch["x"], torch.ones(4, 3))
    assert seen[0]["x"].shape == (4, 3) and result.spec_source == "given"
    rec.flush()
    spans = {e.phase: (e.value, e.ts) for e in rec._ledger.read() if e.kind is EventKind.PHASE_END}
    assert set(spans) == {Phase.COMPILE, Phase.GET_FIRST_BATCH_DATA, Phase.RESTORE}
    latest_begin = max(begin for begin, _ in spans.values())
    assert all(end >= latest_begin for _, end in spans.values())  # the three spans overlap
    # The real batch's spec is kept for the next attempt.
    assert fastbatch.load_spec(fastbatch.job_file(tmp_path)) == fastbatch.spec_of(result.first_batch)
    rec.close()


def test_fast_start_uses_the_spec_kept_by_an_earlier_attempt(tmp_path):
    rec = _recorder(tmp_path)
    fastbatch.save_spec(fastbatch.job_file(tmp_path), {"x": TensorSpec(shape=(2, 8), dtype="float32")})
    shapes = []
    result = fast_start(lambda b: shapes.append(b["x"].shape), lambda: {"x": torch.zeros(2, 8)}, rec=rec)
    assert result.spec_source == "run_dir" and shapes == [(2, 8)]
    rec.close()


def test_without_a_spec_the_warmup_runs_on_the_real_first_batch(tmp_path):
    rec = _recorder(tmp_path)
    got = []
    real = {"x": torch.arange(6.0).reshape(2, 3)}
    result = fast_start(got.append, lambda: real, rec=rec)
    assert result.spec_source == "first_batch" and got == [real]
    rec.close()


def test_errors_of_the_helper_threads_reach_the_caller_after_recording(tmp_path):
    rec = _recorder(tmp_path)

    def broken_loader():
        raise RuntimeError("loader died")

    spec = {"x": TensorSpec(shape=(1,), dtype="float32")}
    with pytest.raises(RuntimeError, match="loader died"):
        fast_start(lambda b: None, broken_loader, spec=spec, rec=rec)
    rec.flush()
    assert {e.phase for e in rec._ledger.read()} >= {Phase.COMPILE, Phase.GET_FIRST_BATCH_DATA}
    rec.close()


def test_warm_up_leaves_no_trace_in_gradients_or_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    warm_up(model, lambda b: model(b).sum())(torch.randn(8, 3) * 10)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_a_kept_spec_the_model_does_not_fit_falls_back_to_the_real_batch(tmp_path, caplog):
    # An earlier attempt (or job) kept [8, 17]; the model now takes 16 features: without the fallback
    # every attempt failed with "mat1 and mat2 shapes cannot be multiplied".
    rec = _recorder(tmp_path)
    fastbatch.save_spec(fastbatch.job_file(tmp_path), {"x": TensorSpec(shape=(8, 17), dtype="float32")})
    model = torch.nn.Sequential(torch.nn.Linear(16, 1), torch.nn.BatchNorm1d(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shapes = []

    def loss_of(batch):
        shapes.append(tuple(batch["x"].shape))
        return model(batch["x"]).sum()

    real = {"x": torch.randn(8, 16)}
    with caplog.at_level("WARNING", logger="ettr"):
        result = fast_start(warm_up(model, loss_of), lambda: real, rec=rec)
    assert shapes == [(8, 17), (8, 16)]  # tried the kept spec, then warmed up on the real batch
    assert result.spec_source == "first_batch" and result.first_batch is real
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "run_dir" in warnings[0] and "first real batch" in warnings[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # The real batch's spec replaces the bad one, so the next attempt warms up on a fitting fast batch.
    assert fastbatch.load_spec(fastbatch.job_file(tmp_path)) == fastbatch.spec_of(real)
    rec.close()


def test_a_kept_spec_too_large_to_synthesize_is_refused(tmp_path):
    path = fastbatch.job_file(tmp_path)
    huge = {"x": TensorSpec(shape=(1 << 20, 1 << 20), dtype="float32")}
    fastbatch.save_spec(path, huge)
    assert fastbatch.load_spec(path) is None  # never synthesized: 2**40 elements
    with pytest.raises(ValueError, match="elements"):
        fastbatch.spec_from_json(fastbatch.spec_to_json(huge))
    at_bound = {"x": TensorSpec(shape=(fastbatch.MAX_SPEC_NUMEL,), dtype="int8")}
    assert fastbatch.spec_from_json(fastbatch.spec_to_json(at_bound)) == at_bound
    split = [TensorSpec(shape=(fastbatch.MAX_SPEC_NUMEL // 2 + 1,), dtype="int8")] * 2
    with pytest.raises(ValueError, match="elements"):  # the bound is on all tensors together
        fastbatch.spec_from_json(fastbatch.spec_to_json(split))


@pytest.mark.parametrize(
    "tensor",
    [
        {"shape": [2], "low": 10**400, "high": 1},  # OverflowError: a traceback out of compile-report
        {"shape": [2], "low": 0, "high": -(10**400)},
        {"shape": [10**400] * 2000, "low": 0, "high": 1},  # refused on its size, no bignum product
    ],
)
def test_a_forged_spec_is_unreadable_never_an_exception(tmp_path, capsys, tensor):
    """The run directory's spec is read at every start of a job using fast batches and by `ettr
    compile-report`: a bound past a float's range raised OverflowError out of both."""
    from ettr.cli import main
    from ettr.events import SUPERVISOR_RANK, Event, EventKind
    from ettr.ledger import open_ledger

    books = open_ledger(tmp_path)  # a run directory that has begun
    books.append([Event(EventKind.SUPERVISOR_START, 1.7e9, 0, SUPERVISOR_RANK, data={"job_id": "j"})])
    books.close()
    path = fastbatch.job_file(tmp_path)
    path.parent.mkdir(parents=True)
    spec = {"__tensor__": True, "dtype": "float32", **tensor}
    path.write_text(json.dumps({"schema": fastbatch.SCHEMA, "spec": spec}))
    assert fastbatch.load_spec(path) is None
    assert fastbatch.read_spec(path)[1] is not None  # said as unreadable
    assert main(["compile-report", str(tmp_path)]) == 0
    assert "could not be read" in capsys.readouterr().out


def test_a_spec_naming_no_torch_dtype_is_not_synthesized():
    with pytest.raises(ValueError, match="not a torch dtype"):
        fastbatch.synthesize(TensorSpec(shape=(1,), dtype="load"))


def test_a_failed_warm_up_also_leaves_no_trace():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_of(batch):
        model(batch)  # BatchNorm's statistics move
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="mat1"):
        warm_up(model, loss_of)(torch.randn(8, 3) * 10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
