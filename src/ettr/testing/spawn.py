"""Real multi-process tests over gloo: run a function on N ranks, each a fresh spawned process.

    from ettr.testing.spawn import run_ranks

    def _body(rank: int, world_size: int, root: str) -> float:   # module level: it is pickled by name
        ...                                                       # the default group is initialised (gloo)
        return value

    def test_x(tmp_path):
        results = run_ranks(_body, 2, str(tmp_path))              # [rank 0's value, rank 1's value]

The ranks rendezvous on a TCPStore the starting process holds (port 0: the OS picks a free port as it binds,
so no other test can take it between the choice and the bind, nor point its ranks at this one's store), and
get the usual torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: that store), an
initialised default process group, and a destroyed one after `fn` returns. `run_ranks` raises `RankFailed` with every failed rank's
traceback or exit status, and kills all ranks if any fails or the timeout passes (no hung test).
`start_ranks` is the same without waiting, for tests that signal or kill ranks themselves.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from ettr.supervisor.launch import free_port

__all__ = ["RankFailed", "free_port", "run_ranks", "start_ranks"]


class RankFailed(AssertionError):
    """One or more ranks raised, exited abnormally, or did not finish in time."""


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any
) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        del store
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException as exc:  # noqa: BLE001 - report every failure to the parent, SystemExit included
        if isinstance(exc, SystemExit):
            results.put((rank, False, f"SystemExit({exc.code})"))
            raise
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Ranks:
    """Started rank processes (`start_ranks`); `wait` collects their results."""

    processes: list[Any]
    results: Any
    timeout_s: float
    store: Any = None
    """The ranks' rendezvous store, held here (let go when `wait` returns)."""

    def wait(self, *, expect_exit: int = 0) -> list[Any]:
        """Join every rank; returns the values of `fn` by rank. Raises RankFailed unless all exited with
        `expect_exit` (for a non-zero one, the values are whatever the ranks reported)."""
        deadline = time.monotonic() + self.timeout_s
        reports: dict[int, tuple[bool, Any]] = {}
        # The results are read while the ranks run: a rank whose value fills the queue's pipe (~64 KiB) cannot
        # exit until it is read, so joining first would wait out the timeout.
        while len(reports) < len(self.processes) and any(p.is_alive() for p in self.processes):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._take_result(reports, min(0.1, left))
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        alive = [i for i, p in enumerate(self.processes) if p.is_alive()]
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        while self._take_result(reports, 0.0):
            pass
        problems = [f"rank {i} did not finish within {self.timeout_s:.0f} s" for i in alive]
        for rank, process in enumerate(self.processes):
            if rank in alive:
                continue
            if process.exitcode != expect_exit:
                detail = reports.get(rank, (False, "no report"))[1]
                problems.append(
                    f"rank {rank} exited with {process.exitcode} (expected {expect_exit}):\n{detail}"
                )
        self.store = None  # every rank is gone: its rendezvous port is let go
        if problems:
            raise RankFailed("\n".join(problems))
        return [reports.get(rank, (False, None))[1] for rank in range(len(self.processes))]

    def _take_result(self, reports: dict[int, tuple[bool, Any]], timeout_s: float) -> bool:
        """One rank's report into `reports`, waiting up to `timeout_s` (0: only one already there)."""
        try:
            rank, ok, value = (
                self.results.get(timeout=timeout_s) if timeout_s > 0 else self.results.get_nowait()
            )
        except queue.Empty:
            return False
        reports[rank] = (ok, value)
        return True


def start_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> Ranks:
    """Spawn `world_size` ranks running `fn(rank, world_size, *args)`; returns without waiting."""
    import torch.distributed as dist

    context = mp.get_context("spawn")
    results = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    processes = []
    for rank in range(world_size):
        process = context.Process(
            target=_rank_main, args=(fn, rank, world_size, port, args, results), daemon=False
        )
        process.start()
        processes.append(process)
    return Ranks(processes, results, timeout_s, store)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns each rank's value, by rank."""
    return start_ranks(fn, world_size, *args, timeout_s=timeout_s).wait()
