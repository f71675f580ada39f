"""A small, fully deterministic training job that uses every part of the checkpoint state.

Used by the fault tests and `benchmarks/checkpoint_faults.py` (and handy as a demo): an MLP with dropout
(torch RNG), AdamW, an LR schedule, a `ResumableSampler` over a fixed dataset, and noise drawn from NumPy's
and Python's global generators each step — so a resume that forgets any part of the state ends with
different parameters. Runs single-threaded so that its arithmetic is reproducible across processes.

    python -m ettr.testing.toyjob --root DIR --steps 40 [--every 5] [--out FINAL.pt]
        [--kill-after-step N] [--kill-at POINT [--kill-on-save K]] [--preemptible] [--mode thread|process]

`--kill-after-step` and `--kill-at` end the process with SIGKILL (after step N; or at a persist point of
`writer.FAULT_POINTS` during the K-th save), the way a machine failure would.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ettr.atomic import atomic_write
from ettr.checkpoint.base import CheckpointConfig
from ettr.checkpoint.manager import CheckpointManager
from ettr.checkpoint.policy import IntervalConfig
from ettr.checkpoint.sampler import ResumableSampler
from ettr.checkpoint.state import TrainState
from ettr.checkpoint.writer import FAULT_POINTS
from ettr.recorder import RecorderProtocol

NUM_SAMPLES = 200
NUM_FEATURES = 16
BATCH_SIZE = 8


@dataclass(frozen=True, kw_only=True)
class ToyJob:
    """One run of the toy job."""

    root: str
    """Checkpoint root (a directory or URL)."""
    num_steps: int = 40
    """Optimizer steps in the whole job."""
    every_steps: int = 5
    """Save after every N-th step."""
    hidden: int = 64
    """Width of the MLP: the checkpoint holds about 3 * hidden^2 floats."""
    seed: int = 0
    mode: str = "thread"
    """Persist mode of the checkpoint manager."""
    keep_last: int = 2
    preemptible: bool = False
    """Handle SIGTERM: save at the next step boundary and exit with 143."""
    kill_after_step: int | None = None
    """SIGKILL this process right after this step (after its save, if any, has started)."""
    kill_at: str | None = None
    """SIGKILL this process at this persist point (`writer.FAULT_POINTS`)..."""
    kill_on_save: int = 1
    """...during the K-th save of this process."""

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.every_steps < 1 or self.hidden < 1:
            raise ValueError("num_steps, every_steps and hidden must be >= 1")
        if self.kill_at is not None and self.kill_at not in FAULT_POINTS:
            raise ValueError(f"kill_at must be one of {', '.join(FAULT_POINTS)}, got {self.kill_at!r}")


class KillAt:
    """A picklable fault hook: SIGKILL this process at `point` on its `nth` occurrence.

    It counts in the process that runs the persist: across saves in thread mode; in process mode each save
    receives a fresh copy in DCP's checkpoint process (so only `nth=1` fires there, and it kills that
    process, not the trainer).
    """

    def __init__(self, point: str, nth: int = 1) -> None:
        self.point, self.nth, self.seen = point, nth, 0

    def __call__(self, point: str) -> None:
        if point == self.point:
            self.seen += 1
            if self.seen == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def _build(job: ToyJob) -> tuple[TrainState, DataLoader[Any], ResumableSampler]:
    torch.set_num_threads(1)
    torch.manual_seed(job.seed)
    random.seed(job.seed)
    np.random.seed(job.seed)
    data_gen = torch.Generator().manual_seed(1234)
    features = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=data_gen)
    targets = features.sum(dim=1, keepdim=True).sin()
    sampler = ResumableSampler(NUM_SAMPLES, seed=job.seed)
    # Its own generator: a DataLoader draws from the global RNG for every new iterator otherwise.
    loader = DataLoader(
        TensorDataset(features, targets), batch_size=BATCH_SIZE, sampler=sampler, generator=torch.Generator()
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, job.hidden),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(job.hidden, job.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(job.hidden, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    return TrainState(model=model, optimizer=optimizer, lr_scheduler=scheduler, data=sampler), loader, sampler


def _train_step(state: TrainState, features: torch.Tensor, targets: torch.Tensor) -> None:
    assert state.optimizer is not None
    noise = float(np.random.randn()) * 1e-3 + random.random() * 1e-3
    loss = torch.nn.functional.mse_loss(state.model(features) + noise, targets)
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.lr_scheduler.step()


def _batches(loader: DataLoader[Any]) -> Any:
    while True:  # epoch after epoch; the sampler carries the position
        yield from loader


def state_digest(state: TrainState) -> str:
    """CRC-32 of every parameter and optimizer tensor, and the scheduler's position (hex)."""
    crc = 0
    for tensor in state.model.state_dict().values():
        crc = zlib.crc32(tensor.detach().contiguous().numpy().tobytes(), crc)
    assert state.optimizer is not None
    for param_state in state.optimizer.state_dict()["state"].values():
        for value in param_state.values():
            if isinstance(value, torch.Tensor):
                crc = zlib.crc32(value.detach().contiguous().numpy().tobytes(), crc)
    crc = zlib.crc32(repr(state.lr_scheduler.state_dict()["last_epoch"]).encode(), crc)
    return f"{crc:08x}"


def reference_digests(job: ToyJob) -> dict[int, str]:
    """The digest after every step of an uninterrupted run without checkpoints (in this process)."""
    state, loader, _ = _build(job)
    digests = {0: state_digest(state)}
    batches = _batches(loader)
    for step in range(1, job.num_steps + 1):
        _train_step(state, *next(batches))
        digests[step] = state_digest(state)
    return digests


def restore_digest(
    root: str, *, hidden: int, seed: int = 0, storage: Any = None
) -> tuple[int | None, str | None]:
    """Restore the newest checkpoint under `root` (through `storage` if given, a fault-injecting one)
    the way a resumed job would: (step, state digest)."""
    step, digest, _ = restore_from(root, hidden=hidden, seed=seed, storage=storage)
    return step, digest


def restore_from(
    root: str, *, hidden: int, seed: int = 0, storage: Any = None
) -> tuple[int | None, str | None, str | None]:
    """`restore_digest` and where the state came from: (step, digest, "memory" | "storage" | None)."""
    from ettr.recorder import NullRecorder

    job = ToyJob(root=root, hidden=hidden, seed=seed)
    state, _, _ = _build(job)
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=1))
    with CheckpointManager(config, state, recorder=NullRecorder(), storage=storage) as manager:
        step = manager.restore()
        source = manager.restored_from
    return step, (state_digest(state) if step is not None else None), source


def run(
    job: ToyJob, *, recorder: RecorderProtocol | None = None, on_step: Callable[[int], None] | None = None
) -> str:
    """Run (or resume) the job to `num_steps`; returns the final state digest."""
    state, loader, _ = _build(job)
    config = CheckpointConfig(
        root=job.root,
        interval=IntervalConfig(every_steps=job.every_steps),
        keep_last=job.keep_last,
        mode=job.mode,
        handle_preemption=job.preemptible,
        fault_hook=KillAt(job.kill_at, job.kill_on_save) if job.kill_at else None,
    )
    if recorder is None:
        import ettr

        recorder = ettr.get_recorder()
    with CheckpointManager.create(config, state, recorder=recorder) as manager:
        step = manager.restore() or 0
        batches = _batches(loader)
        while step < job.num_steps:
            _train_step(state, *next(batches))
            step += 1
            recorder.step(step)
            manager.after_step(step)
            if on_step is not None:
                on_step(step)
            if step == job.kill_after_step:
                os.kill(os.getpid(), signal.SIGKILL)
        manager.finish(step)  # raises (non-zero exit) if the final save does not commit
    return state_digest(state)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ettr.testing.toyjob", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("thread", "process"), default="thread")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--preemptible", action="store_true")
    parser.add_argument("--kill-after-step", type=int)
    parser.add_argument("--kill-at", choices=FAULT_POINTS)
    parser.add_argument("--kill-on-save", type=int, default=1)
    parser.add_argument(
        "--step-delay-s", type=float, default=0.0, help="sleep per step (slows the job for tests)"
    )
    parser.add_argument("--out", help="write the final state digest to this file")
    args = parser.parse_args(argv)
    job = ToyJob(
        root=args.root,
        num_steps=args.steps,
        every_steps=args.every,
        hidden=args.hidden,
        seed=args.seed,
        mode=args.mode,
        keep_last=args.keep_last,
        preemptible=args.preemptible,
        kill_after_step=args.kill_after_step,
        kill_at=args.kill_at,
        kill_on_save=args.kill_on_save,
    )
    on_step = None
    if args.step_delay_s > 0:
        import time

        def on_step(step: int) -> None:
            print(f"step {step}", flush=True)
            time.sleep(args.step_delay_s)

    digest = run(job, on_step=on_step)
    if args.out:
        atomic_write(args.out, digest + "\n")
    print(f"done {args.steps} steps, digest {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
