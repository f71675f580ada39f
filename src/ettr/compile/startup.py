"""Parallel start-up: compile on a fast batch while the data loader warms up and the checkpoint is read.

    it = iter(loader)                          # forks the workers now, before any compile thread runs
    result = ettr.compile.fast_start(
        warm_up(model, lambda b: loss_fn(model(b["x"]), b["y"])),
        lambda: next(it),
        restore=lambda: torch.load(path, map_location="cpu"),   # read only; apply it afterwards
    )
    model.load_state_dict(result.restored["model"])
    train_step(result.first_batch)             # compiled already: no compile in the first step

The compile warm-up runs on the calling thread, the first batch and the checkpoint read on two helper
threads, so the start-up takes about the longest of the three instead of their sum. `restore` should
only *read*: applying a state dict while the warm-up runs backward on the same parameters would race.
Each part is recorded as its own phase (COMPILE, GET_FIRST_BATCH_DATA, RESTORE), so the report shows
the overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ettr.compile import fastbatch
from ettr.events import Phase

if TYPE_CHECKING:
    from ettr.compile.session import CompileSession
    from ettr.recorder import EventSink

logger = logging.getLogger("ettr")


@dataclass(frozen=True, kw_only=True)
class StartupResult:
    """What `fast_start` got, and how long each part took."""

    first_batch: Any
    """The first real batch."""
    restored: Any
    """What `restore` returned (None without one)."""
    spec_source: str
    """Where the fast batch's spec came from: `given`, `run_dir`, `store`, or `first_batch` (no spec was
    known, or the warm-up on the fast batch failed, so the warm-up ran on the real batch)."""
    phases_s: Mapping[str, float]
    """Seconds of `compile`, `data` and `restore` (each measured on its own thread)."""
    wall_s: float
    """Seconds from the call to the return: about the longest phase when they overlap."""


class _Task:
    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name, self.fn = name, fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.begin_ts = self.end_ts = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"ettr-startup-{name}", daemon=True)

    def _run(self) -> None:
        self.begin_ts = time.time()
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller's thread
            self.error = exc
        finally:
            self.end_ts = time.time()
            self.done.set()


def _resolve_spec(spec: Any, rec: EventSink, session: CompileSession | None) -> tuple[Any, str]:
    if spec is not None:
        return spec, "given"
    run_dir = rec.run_dir
    if run_dir is not None:
        cached = fastbatch.load_spec(fastbatch.job_file(run_dir))
        if cached is not None:
            return cached, "run_dir"
    if session is not None:
        session.prepare()  # restores the store entry now (the first compile would do it anyway)
        document = session.store_meta.get("batch_spec")
        if document is not None:
            try:
                return fastbatch.spec_from_json(document), "store"
            except ValueError:
                pass
    return None, "first_batch"


def _shapes(spec: Any) -> Any:
    if isinstance(spec, fastbatch.TensorSpec):
        return (spec.shape, spec.dtype)
    if isinstance(spec, Mapping):
        return {k: _shapes(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return [_shapes(v) for v in spec]
    return spec


def fast_start(
    warmup: Callable[[Any], Any],
    first_batch: Callable[[], Any],
    *,
    restore: Callable[[], Any] | None = None,
    spec: Any = None,
    rec: EventSink | None = None,
    device: Any = None,
) -> StartupResult:
    """Run the compile warm-up on a synthetic batch while `first_batch()` and `restore()` run on helper
    threads; return when all three are done. Re-raises (on this thread) what `first_batch` or `restore`
    raised, after the phases are recorded.

    Args:
        warmup: compiles by running the model on a batch (see `warm_up`); called on this thread.
        first_batch: returns the first real batch (create the loader's iterator before calling).
        restore: reads the checkpoint and returns it (do not apply it to the model here).
        spec: the fast batch's spec; default: the first real batch of an earlier attempt of this job
            (run directory), else of an earlier job (compile store). With none, the warm-up waits for
            the real first batch and runs on it (the checkpoint read still overlaps); so it does, after
            one logged warning, when the warm-up on the synthetic batch raises (a spec the model no
            longer fits would otherwise fail every attempt).
        rec: Recorder (default: this process's); `device`: where synthetic batches go (default: the
            devices of the spec).
    """
    if rec is None:
        from ettr.runtime import get_recorder

        rec = get_recorder()
    from ettr.compile.autoinstall import current_session

    session = current_session()
    start = time.time()
    data = _Task("data", first_batch)
    reader = _Task("restore", restore) if restore is not None else None
    data.thread.start()
    if reader is not None:
        reader.thread.start()

    compile_begin = time.time()
    spec, spec_source = _resolve_spec(spec, rec, session)
    if spec is not None and not _warm_up_on_spec(warmup, spec, spec_source, device):
        spec, spec_source = None, "first_batch"
    if spec is None:
        data.done.wait()
        batch = data.result if data.error is None else None
        if batch is not None:
            warmup(batch)
    compile_end = time.time()

    data.done.wait()
    if reader is not None:
        reader.done.wait()

    _record(rec, "compile", Phase.COMPILE, compile_begin, compile_end, spec_source)
    _record(rec, "data", Phase.GET_FIRST_BATCH_DATA, data.begin_ts, data.end_ts, spec_source)
    if reader is not None:
        _record(rec, "restore", Phase.RESTORE, reader.begin_ts, reader.end_ts, spec_source)
    for task in (data, reader):
        if task is not None and task.error is not None:
            raise task.error

    _remember_spec(rec, session, data.result, spec)
    phases = {"compile": compile_end - compile_begin, "data": data.end_ts - data.begin_ts}
    if reader is not None:
        phases["restore"] = reader.end_ts - reader.begin_ts
    return StartupResult(
        first_batch=data.result,
        restored=None if reader is None else reader.result,
        spec_source=spec_source,
        phases_s=phases,
        wall_s=time.time() - start,
    )


def _warm_up_on_spec(warmup: Callable[[Any], Any], spec: Any, spec_source: str, device: Any) -> bool:
    # A kept spec may not fit the model any more (an earlier job's model changed, a hand-edited file): the
    # warm-up then fails on every attempt, so it runs on the real first batch instead, as without a spec.
    try:
        warmup(fastbatch.synthesize(spec, device=device))
        return True
    except Exception as exc:
        logger.warning(
            "ettr: the compile warm-up on the fast batch (spec from %s) failed (%s: %s); warming up on "
            "the first real batch instead",
            spec_source,
            type(exc).__name__,
            " ".join(str(exc).split())[:300],  # one line; Dynamo's first line alone says little
        )
        return False


def _record(
    rec: EventSink, part: str, phase: Phase, begin_ts: float, end_ts: float, spec_source: str
) -> None:
    try:
        rec.span(phase, begin_ts, end_ts, source="fast_start", part=part, spec_source=spec_source)
    except Exception as exc:
        logger.debug("ettr: cannot record the %s phase: %s", part, exc)


def _remember_spec(rec: EventSink, session: CompileSession | None, batch: Any, used: Any) -> None:
    # The next attempt (run directory) and later jobs (store, at the session's next save) start from it.
    try:
        real = fastbatch.spec_of(batch)
    except Exception as exc:
        logger.debug("ettr: cannot describe the first batch: %s", exc)
        return
    if used is not None and _shapes(used) != _shapes(real):
        logger.info(
            "ettr: the first real batch differs in shape from the fast batch; the first step compiles"
        )
    try:
        run_dir = rec.run_dir
        if run_dir is not None and rec.rank == 0:
            fastbatch.save_spec(fastbatch.job_file(run_dir), real)
        if session is not None:
            session.batch_spec = fastbatch.spec_to_json(real)
    except Exception as exc:
        logger.debug("ettr: cannot keep the batch spec: %s", exc)


def warm_up(model: Any, loss_of: Callable[[Any], Any]) -> Callable[[Any], None]:
    """A `fast_start` warm-up: runs `loss_of(batch)` and its backward (compiling forward and backward),
    then puts the model's gradients and buffers (BatchNorm statistics, ...) back as they were, so the
    synthetic batch leaves no trace in training."""
    import torch

    def run(batch: Any) -> None:
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
        try:  # put back also after a failure: fast_start then warms up again on the real batch
            loss = loss_of(batch)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
                for param, grad in grads:
                    param.grad = grad

    return run
