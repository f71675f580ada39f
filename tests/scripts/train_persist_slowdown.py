"""A training job that saves with ettr.checkpoint in process mode and measures its own step slowdown.

    python train_persist_slowdown.py RUN_DIR ROUNDS

Records its events into RUN_DIR's ledger; prints one JSON line: its own median step time with a persist
running and without (step end to step end, like the report; the step right after a save is left out), and the
nice values of the checkpoint process and of itself.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, PersistMode, TrainState
from ettr.ledger import open_ledger
from ettr.recorder import Recorder


def main() -> None:
    run_dir, rounds = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # ~100 MiB with AdamW
    big_opt = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 1024)).sum().backward()
    big_opt.step()
    big_opt.zero_grad(set_to_none=True)
    small = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(24)])
    small_opt = torch.optim.SGD(small.parameters(), lr=1e-3)
    batch = torch.randn(32, 128)
    rec = Recorder(open_ledger(run_dir), run_dir=run_dir, job_id="persist-slowdown")
    config = CheckpointConfig(
        root=os.path.join(run_dir, "ckpt"),
        interval=IntervalConfig(every_steps=10**9),
        mode=PersistMode.PROCESS,
    )
    quiet: list[float] = []
    busy: list[float] = []
    kinds: list[tuple[int, str]] = []
    number = 0
    last_end = time.perf_counter()

    def step(into: list[float] | None) -> None:
        """One step; its time is from the previous step's end to this one's (what STEP events measure)."""
        nonlocal number, last_end
        small(batch).pow(2).mean().backward()
        small_opt.step()
        small_opt.zero_grad()
        end = time.perf_counter()
        if into is not None:
            into.append(end - last_end)
            kinds.append((number + 1, "busy" if into is busy else "quiet"))
        last_end = end
        number += 1
        rec.step(number)

    with CheckpointManager.create(config, TrainState(model=big, optimizer=big_opt), recorder=rec) as manager:
        for _ in range(10):
            step(None)
        manager.save(number, wait=True)
        for round_index in range(rounds):
            for busy_turn in (True, False) if round_index % 2 == 0 else (False, True):
                for _ in range(3):
                    step(None)
                if busy_turn:
                    manager.save(number)
                    step(None)
                    while manager.persisting:
                        step(busy)
                    assert manager.wait()
                else:
                    for _ in range(30):
                        step(quiet)
        children = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
        nice = {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in children}
    rec.close()
    print(
        json.dumps(
            {
                "direct": statistics.median(busy) / statistics.median(quiet),
                "num_busy": len(busy),
                "children_nice": list(nice.values()),
                "own_nice": os.getpriority(os.PRIO_PROCESS, 0),
                "kinds": kinds,
            }
        )
    )


if __name__ == "__main__":
    main()
