"""How long a checkpoint save blocks the training loop, side by side, and how much a background persist
slows the training steps that run beside it.

For one ~1 GiB training state (an MLP's parameters plus AdamW's two moments), measured in rounds (each in a
different order) so that disk-speed drift and the machine's other load hit every method alike, median
seconds the loop is blocked per save:
    torch_save       plain `torch.save` of model + optimizer state dicts
    dcp_save         `dcp.save`
    dcp_async_save   `dcp.async_save` with its defaults (a fresh, synchronous stager per call)
    ettr             `CheckpointManager.save` as configured by default: the copy into staging buffers
                     reused across saves overlaps the next step's forward and backward; blocking is the
                     time `save` takes plus the wait for the rest of the copy before the optimizer step
    ettr_no_overlap  the same with `overlap_staging=False` (the save returns with the copy complete)
    memcpy_limit     copying the same tensors into preallocated memory: the physical limit of a safe copy
After every save the next training step's forward and backward of the same model run (untimed), for every
method alike; each save's persist is finished before the next measurement, so none includes a wait for it.

Then the step slowdown, for the thread and the process persist modes: in one process, interleaved rounds
of "persist running" (a save of the 1 GiB state, then steps until its persist ends) and "no persist" (as
many steps), each after the same few untimed steps, the order flipped every round; the median time of a
small training step in the first kind over its median in the second. The run's events go through a
Recorder into a ledger, and the report's own figure (`EttReport.slowdown.inflation`) is printed beside.

    python benchmarks/checkpoint_stall.py [--size-gib 1.0] [--saves 3] [--dir DIR] [--json]

`--json` ends with one object: blocking_s {torch_save, dcp_save, dcp_async_save, ettr, ettr_no_overlap,
memcpy_limit}, step_slowdown {thread, process} (direct), report_step_slowdown {thread, process}, and the ratios and extras it is judged by.
`--quick` (what CI runs): a 0.05 GiB state, one save per method, one slowdown round per mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.recorder import Recorder

NUM_LAYERS = 8


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def build_state(size_gib: float) -> tuple[TrainState, int]:
    """An MLP whose parameters plus AdamW state come to about `size_gib`, with the optimizer stepped once."""
    # weights + exp_avg + exp_avg_sq: 12 bytes per parameter; a width that is a multiple of 64
    width = max(64, round((size_gib * 2**30 / (NUM_LAYERS * 12)) ** 0.5 / 64) * 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(NUM_LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # grads are not part of a checkpoint; free their memory
    state = TrainState(model=model, optimizer=optimizer)
    num_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, num_bytes


def _tensors(state: TrainState) -> list[torch.Tensor]:
    tensors = [t for t in state.model.state_dict().values()]
    for param_state in state.optimizer.state.values():
        tensors += [v for v in param_state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def _plain_state_dict(state: TrainState) -> dict[str, Any]:
    return {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}


def _dcp_state_dict(state: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optim": optim_sd}


class Methods:
    """The save methods under test, each returning the seconds the training loop was blocked.

    After every save the next training step's forward and backward run (untimed, for every method alike):
    ettr's overlapped copy runs meanwhile, and the loop then waits for whatever is left of it — what the
    optimizer step pre-hook does — which counts as blocking.
    """

    def __init__(self, state: TrainState, workdir: str, step_batch: int) -> None:
        self.state = state
        self.workdir = workdir
        self.count = 0
        self.persist_s: list[float] = []
        self.compute_s: list[float] = []
        self.dst = [torch.empty_like(t) for t in _tensors(state)]
        self.managers = {
            overlap: CheckpointManager(
                CheckpointConfig(
                    root=os.path.join(workdir, f"ettr-{overlap}"),
                    interval=IntervalConfig(every_steps=10**9),
                    overlap_staging=overlap,
                ),
                state,
                recorder=Recorder(None),
            )
            for overlap in (True, False)
        }
        width = state.model[0].in_features
        self.batch = torch.randn(step_batch, width)

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()

    def _next_step_compute(self) -> None:
        """The next training step's forward and backward (no optimizer step: the state stays as saved)."""
        begin = time.perf_counter()
        self.state.model(self.batch).pow(2).mean().backward()
        self.state.model.zero_grad(set_to_none=True)
        self.compute_s.append(time.perf_counter() - begin)

    def _target(self, name: str) -> str:
        self.count += 1
        return os.path.join(self.workdir, f"{name}-{self.count}")

    def torch_save(self) -> float:
        path = self._target("torch") + ".pt"
        begin = time.perf_counter()
        torch.save(_plain_state_dict(self.state), path)
        blocked = time.perf_counter() - begin
        self._next_step_compute()
        os.remove(path)
        return blocked

    def dcp_save(self) -> float:
        path = self._target("dcp")
        begin = time.perf_counter()
        dcp.save(_dcp_state_dict(self.state), checkpoint_id=path)
        blocked = time.perf_counter() - begin
        self._next_step_compute()
        shutil.rmtree(path)
        return blocked

    def dcp_async_save(self) -> float:
        path = self._target("dcp-async")
        begin = time.perf_counter()
        future = dcp.async_save(_dcp_state_dict(self.state), checkpoint_id=path)
        blocked = time.perf_counter() - begin  # its default stager copies before returning
        self._next_step_compute()
        future.result()
        shutil.rmtree(path)
        return blocked

    def _ettr(self, overlap: bool) -> float:
        manager = self.managers[overlap]
        self.count += 1
        begin = time.perf_counter()
        manager.save(self.count)
        blocked = time.perf_counter() - begin
        self._next_step_compute()
        begin = time.perf_counter()
        manager.wait_staged()  # what the optimizer step pre-hook does before the parameters change
        blocked += time.perf_counter() - begin
        assert manager.wait(), "an ettr save failed"
        return blocked

    def ettr(self) -> float:
        return self._ettr(True)

    def ettr_no_overlap(self) -> float:
        begin = time.perf_counter()
        blocked = self._ettr(False)
        self.persist_s.append(time.perf_counter() - begin - (self.compute_s[-1] if self.compute_s else 0.0))
        return blocked

    def memcpy_limit(self) -> float:
        begin = time.perf_counter()
        for src, dst in zip(_tensors(self.state), self.dst, strict=True):
            dst.copy_(src)
        blocked = time.perf_counter() - begin
        self._next_step_compute()
        return blocked


def measure_blocking(
    state: TrainState, workdir: str, num_saves: int, step_batch: int
) -> tuple[dict[str, float], dict[str, Any]]:
    methods = Methods(state, workdir, step_batch)
    names = ["torch_save", "dcp_save", "dcp_async_save", "ettr", "ettr_no_overlap", "memcpy_limit"]
    # One unmeasured round: ettr allocates its staging buffers on the first save (reported below), the
    # copy target is faulted in, and every library path is warm.
    first = {name: getattr(methods, name)() for name in names}
    _say("first (warm-up) save, s: " + ", ".join(f"{n} {first[n]:.3f}" for n in names))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(num_saves):
        # a different order every round: what one save leaves behind (freed buffers, deleted files) must not
        # always land on the same neighbour
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(getattr(methods, name)())
        _say(f"round {round_index + 1}: " + ", ".join(f"{n} {samples[n][-1]:.3f}" for n in names))
    methods.close()
    extras = {
        "first_save_s": first,
        "ettr_persist_s": statistics.median(methods.persist_s[1:] or methods.persist_s),
        "next_step_compute_s": statistics.median(methods.compute_s),
    }
    return {name: statistics.median(values) for name, values in samples.items()}, extras


def _step_fn() -> Callable[[], None]:
    """A small training step with many small ops, so that much of its time is Python dispatch under the
    GIL — like the Python side of a GPU training loop (its own model: the checkpointed state is untouched)."""
    torch.manual_seed(1)
    layers: list[torch.nn.Module] = []
    for _ in range(24):
        layers += [torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batch = torch.randn(32, 128)

    def step() -> None:
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def _timed_step(step: Callable[[], None], rec: Recorder, number: int) -> float:
    begin = time.perf_counter()
    step()
    elapsed = time.perf_counter() - begin
    rec.step(number)
    return elapsed


def measure_slowdown(state: TrainState, workdir: str, mode: str, num_rounds: int) -> dict[str, float]:
    """One process, interleaved rounds of "persist running" and "no persist", each after the same few
    untimed steps, the order flipped every round; the run's events go through a Recorder into a ledger,
    and the report's own figure (`EttReport.slowdown`) is computed beside the direct one."""
    from ettr.accounting import compute
    from ettr.ledger import open_ledger, read_run_events

    step = _step_fn()
    run_dir = os.path.join(workdir, f"run-{mode}")
    os.makedirs(run_dir)
    rec = Recorder(open_ledger(run_dir), run_dir=run_dir, job_id=f"stall-{mode}")
    config = CheckpointConfig(
        root=os.path.join(workdir, f"slowdown-{mode}"), interval=IntervalConfig(every_steps=10**9), mode=mode
    )
    quiet: list[float] = []
    busy: list[float] = []
    persists: list[float] = []
    number = 0

    def steps(count: int, into: list[float] | None) -> int:
        nonlocal number
        for _ in range(count):
            number += 1
            elapsed = _timed_step(step, rec, number)
            if into is not None:
                into.append(elapsed)
        return count

    with CheckpointManager.create(config, state, recorder=rec) as manager:
        steps(10, None)
        manager.save(number, wait=True)  # warm-up: buffers (and in process mode the checkpoint process)
        last_busy = 20
        for round_index in range(num_rounds):
            for busy_turn in (True, False) if round_index % 2 == 0 else (False, True):
                steps(3, None)  # the same warm-up before either kind of phase
                if not busy_turn:
                    steps(last_busy, quiet)
                    continue
                begin = time.perf_counter()
                manager.save(number)
                steps(1, None)  # this step waits for the rest of the staging copy: blocking, not slowdown
                count = 0
                while manager.persisting:
                    count += steps(1, busy)
                assert manager.wait(), f"a {mode}-mode save failed"
                persists.append(time.perf_counter() - begin)
                last_busy = max(count, 5)
    rec.close()
    events = read_run_events(run_dir)
    report = compute(events, now=max(e.ts for e in events))
    found = report.slowdown
    quiet_s, busy_s = statistics.median(quiet), statistics.median(busy) if busy else float("nan")
    direct = busy_s / quiet_s
    reported = found.inflation if found is not None and found.inflation is not None else float("nan")
    _say(
        f"{mode} mode: step {quiet_s * 1e3:.2f} ms alone, {busy_s * 1e3:.2f} ms during persist "
        f"({len(busy)} busy / {len(quiet)} quiet steps over {num_rounds} rounds, median persist "
        f"{statistics.median(persists):.2f} s); the report says {reported:.3f}x"
    )
    return {
        "slowdown": direct,
        "report_slowdown": reported,
        "report_over_direct": reported / direct,
        "report_extra_s": found.extra_s if found is not None and found.extra_s is not None else float("nan"),
        "quiet_step_s": quiet_s,
        "busy_step_s": busy_s,
        "num_busy_steps": len(busy),
        "num_quiet_steps": len(quiet),
        "persist_s": statistics.median(persists),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-gib", type=float, default=1.0, help="size of the training state (default 1.0)"
    )
    parser.add_argument("--saves", type=int, default=3, help="measured saves per method (default 3)")
    parser.add_argument(
        "--slowdown-saves",
        type=int,
        default=6,
        help="interleaved rounds (one persist each) per mode for the step slowdown (default 6)",
    )
    parser.add_argument(
        "--step-batch",
        type=int,
        default=32,
        help="batch of the forward/backward after each save (default 32)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default 0: torch's own choice); on a busy machine with few cores the "
        "default oversubscribes them and the thread-mode figure measures that contention",
    )
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="a small state, one round (CI's check that it runs)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.saves, args.slowdown_saves = 0.05, 1, 1
    if args.size_gib <= 0 or args.saves < 1 or args.slowdown_saves < 1:
        parser.error("--size-gib must be > 0, --saves and --slowdown-saves >= 1")
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="ettr-stall-", dir=args.dir)
    try:
        state, num_bytes = build_state(args.size_gib)
        _say(f"state: {num_bytes / 2**30:.2f} GiB in {len(_tensors(state))} tensors; scratch {workdir}")
        blocking, extras = measure_blocking(state, workdir, args.saves, args.step_batch)
        thread = measure_slowdown(state, workdir, "thread", args.slowdown_saves)
        process = measure_slowdown(state, workdir, "process", args.slowdown_saves)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = {
        "ettr_over_memcpy": blocking["ettr"] / blocking["memcpy_limit"],
        "ettr_no_overlap_over_memcpy": blocking["ettr_no_overlap"] / blocking["memcpy_limit"],
        "torch_save_over_ettr": blocking["torch_save"] / blocking["ettr"],
        "dcp_async_save_over_ettr": blocking["dcp_async_save"] / blocking["ettr"],
    }
    print(f"training-loop blocking per save, median of {args.saves} (state {num_bytes / 2**30:.2f} GiB):")
    for name, value in blocking.items():
        print(f"  {name:15s} {value:8.3f} s")
    print(f"  ettr / memcpy limit      {ratios['ettr_over_memcpy']:6.2f}x   (goal <= 2)")
    print(f"  torch.save / ettr        {ratios['torch_save_over_ettr']:6.1f}x   (goal >= 10)")
    print(
        f"  (after each save the next step's forward+backward ran, {extras['next_step_compute_s']:.3f} s; "
        "ettr's copy overlaps it and the loop waits for the rest before the optimizer step)"
    )
    print(f"  ettr first save (allocates its staging buffers once): {extras['first_save_s']['ettr']:.3f} s")
    print(f"  ettr persist (overlapped with training), median: {extras['ettr_persist_s']:.2f} s")
    print(
        "step time during a background persist / without, interleaved rounds (direct | the report's own"
        " figure from the run's ledger):"
    )
    for name, result in (("thread", thread), ("process", process)):
        print(
            f"  {name:8s} {result['slowdown']:.3f}x | report {result['report_slowdown']:.3f}x "
            f"(report/direct {result['report_over_direct']:.3f}; {result['quiet_step_s'] * 1e3:.2f} -> "
            f"{result['busy_step_s'] * 1e3:.2f} ms per step over {result['num_busy_steps']} steps; "
            f"persist {result['persist_s']:.2f} s vs {extras['ettr_persist_s']:.2f} s with an idle loop)"
        )
    if args.json:
        result = {
            "blocking_s": blocking,
            "step_slowdown": {"thread": thread["slowdown"], "process": process["slowdown"]},
            "report_step_slowdown": {
                "thread": thread["report_slowdown"],
                "process": process["report_slowdown"],
            },
            "ratios": ratios,
            "state_bytes": num_bytes,
            "intra_op_threads": torch.get_num_threads(),
            "num_saves": args.saves,
            "first_save_s": extras["first_save_s"],
            "ettr_persist_s": extras["ettr_persist_s"],
            "next_step_compute_s": extras["next_step_compute_s"],
            "slowdown_detail": {"thread": thread, "process": process},
            "quick": args.quick,
        }
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
