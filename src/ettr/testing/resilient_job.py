"""A deterministic 2+-rank DDP job under `ettr.resilient`, with one fault on purpose: for the in-place tests
and `benchmarks/recovery.py`.

    torchrun --standalone --nproc-per-node 2 -m ettr.testing.resilient_job --ckpt-dir DIR --timings LOG \\
        [--steps 40] [--every 5] [--fault raise|exit|kill] [--fail-at 17] [--fail-rank 1]
        [--no-resilient] [--no-memory-copy] [--hidden 64] [--step-s 0] [--fail-after-s 0]
        [--fail-when PATH [--fail-wait-max-s 120]] [--pause-at STEP] [--keep-last 2]

Every rank trains the same DDP model on its own shard of a fixed dataset (`ResumableSampler`), saving with
ettr's `CheckpointManager` every `--every` steps (memory copies on). The fault fires once per job (a marker
beside the log) on `--fail-rank` right after step `--fail-at`: `raise` (an exception the process survives),
`exit` (`os._exit(1)`: the process dies) or `kill` (SIGKILL); with `--fail-after-s` it first waits until the
process has trained that long (since its first step) (a job that trained a while, whose supervisor's warm standbys are ready),
and with `--fail-when` until the file PATH exists too (`benchmarks/recovery.py` makes it once the supervisor's
standbys are warm; at most `--fail-wait-max-s`); with `--pause-at STEP` every rank waits for that file after
step STEP (a test acts on the job meanwhile). `--no-resilient` runs the same training
without the wrapper (the process restart baseline); `--no-memory-copy` restores from storage. Each line of
`--timings` is JSON: {"ev": "start" | "train" | "step" | "fault" | "restored" | "done", "ts", "pid", "rank",
"step", ...}; "train" starts a generation (`generation`: its index, -1 without the wrapper), "restored" says
from where (`source`), "done" carries the final state's digest. `committed_digests` reads the same digest
from each committed checkpoint (a job that stopped before "done").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import zlib
from typing import Any

import torch

_TRAINING = {"since": 0.0}  # when this process completed its first step
NUM_SAMPLES = 512
FEATURES = 16


def log(path: str, **fields: Any) -> None:
    line = json.dumps({"ts": time.time(), "pid": os.getpid(), **fields})
    with open(path, "a") as f:  # one short O_APPEND write per line: the ranks' lines never interleave
        f.write(line + "\n")


def _fire(args: argparse.Namespace, rank: int, step: int) -> None:
    try:
        os.close(os.open(args.log + ".fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # once per job
    wait_s = args.fail_after_s - (time.time() - _TRAINING["since"])
    waits_for = args.fail_when is not None and not os.path.exists(args.fail_when)
    if wait_s > 0 or waits_for:  # a job that has trained a while: its supervisor's warm standbys are ready
        import ettr

        # Booked as an evaluation, as a job that pauses its steps would: silence outside a phase is a hang
        # to `ettr run`'s watchdog after 10 s, which would kill the job before its fault.
        with ettr.phase(ettr.Phase.EVAL):
            time.sleep(max(wait_s, 0.0))
            deadline = time.monotonic() + args.fail_wait_max_s
            while waits_for and not os.path.exists(args.fail_when) and time.monotonic() < deadline:
                time.sleep(0.05)  # the benchmark makes the file
    log(args.log, ev="fault", rank=rank, step=step, kind=args.fault)
    if args.fault == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if args.fault == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _pause(args: argparse.Namespace) -> None:
    """Every rank waits after step `--pause-at` until `--fail-when` exists (at most `--fail-wait-max-s`),
    booked as an evaluation (see `_fire`): a test acts on the job meanwhile (its spares parked)."""
    import ettr

    deadline = time.monotonic() + args.fail_wait_max_s
    with ettr.phase(ettr.Phase.EVAL):
        while not os.path.exists(args.fail_when) and time.monotonic() < deadline:
            time.sleep(0.05)


def collective_timeout_s(args: argparse.Namespace) -> float:
    """The process group's collective timeout: 60 s beyond the longest the fault may wait before it fires.
    The other ranks sit in the next step's all-reduce meanwhile: with a fixed 60 s, a wait for the standbys
    longer than that (`--fail-wait-max-s` 120 on a loaded machine) ended the job with a gloo timeout on the
    peer, not the fault, and `benchmarks/recovery.py` measured nothing."""
    waits = args.fail_after_s + (args.fail_wait_max_s if args.fail_when is not None else 0.0)
    return 60.0 + max(waits, 0.0)


def digest(model: torch.nn.Module) -> str:
    crc = 0
    for tensor in model.state_dict().values():
        crc = zlib.crc32(tensor.detach().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def build_model(hidden: int) -> torch.nn.Module:
    """The job's model (before DDP wraps it), with its initial parameters."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def committed_digests(ckpt_dir: str, hidden: int = 64) -> dict[int, str]:
    """The model digest (`digest`, as "done" carries it) of each committed checkpoint in `ckpt_dir` that
    verifies, by step, read in this process without a process group: the state a job that stopped early left
    behind, to compare with an uninterrupted run's at the same step (its last one: its "done" digest)."""
    import torch.distributed.checkpoint as dcp

    from ettr.checkpoint import CheckpointError, list_checkpoints, open_storage, verify
    from ettr.checkpoint.trust import SafeLoadPlanner, verified_reader

    storage = open_storage(ckpt_dir)
    found: dict[int, str] = {}
    for checkpoint in list_checkpoints(storage):
        try:
            manifest = verify(storage, checkpoint.name)
        except (CheckpointError, OSError):
            continue
        model = build_model(hidden)
        target = {"model": model.state_dict()}
        dcp.load(
            target,
            storage_reader=verified_reader(storage, checkpoint.name, manifest),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
        model.load_state_dict(target["model"])
        found[manifest.step] = digest(model)
    return found


def train(rank: int, world_size: int, args: argparse.Namespace, generation: int = -1) -> str:
    """One generation: build, restore (memory first), train to the end; returns the final digest."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    import ettr
    from ettr.checkpoint import (
        CheckpointConfig,
        CheckpointManager,
        IntervalConfig,
        ResumableSampler,
        TrainState,
    )

    log(args.log, ev="train", rank=rank, step=None, generation=generation)
    torch.manual_seed(0)
    data = torch.randn(NUM_SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
    targets = data.sum(dim=1, keepdim=True).sin()
    model = DistributedDataParallel(build_model(args.hidden))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ResumableSampler(NUM_SAMPLES, seed=0, rank=rank, world_size=world_size)
    loader = DataLoader(
        TensorDataset(data, targets), batch_size=8, sampler=sampler, generator=torch.Generator()
    )
    state = TrainState(model=model, optimizer=optimizer, data=sampler)
    config = CheckpointConfig(
        root=args.ckpt_dir,
        interval=IntervalConfig(every_steps=args.every),
        keep_last=args.keep_last,
        memory_copy=args.memory_copy,
        memory_interval=args.memory_interval,
    )
    with CheckpointManager.create(config, state) as ckpt:
        step = ckpt.restore() or 0
        log(args.log, ev="restored", rank=rank, step=step, source=ckpt.restored_from, tier=ckpt.restored_tier)
        dist.barrier()
        while step < args.steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                time.sleep(args.step_s)
                optimizer.step()
                step += 1
                ettr.step(step)
                log(args.log, ev="step", rank=rank, step=step)
                _TRAINING["since"] = _TRAINING["since"] or time.time()
                if step == args.pause_at and args.fail_when is not None:
                    _pause(args)
                if args.fault != "none" and rank == args.fail_rank and step == args.fail_at:
                    _fire(args, rank, step)
                ckpt.after_step(step)
                if step == args.steps:
                    break
        ckpt.finish(step)
    return digest(model.module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ettr.testing.resilient_job")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--timings", dest="log", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--keep-last", type=int, default=2, help="checkpoints kept (a reference run: all)")
    parser.add_argument("--fault", choices=("none", "raise", "exit", "kill"), default="none")
    parser.add_argument("--fail-at", type=int, default=17)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep per step (a slower step)")
    parser.add_argument("--resilient", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rendezvous-timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--fail-after-s",
        type=float,
        default=0.0,
        help="the fault waits until the process has trained this long",
    )
    parser.add_argument("--fail-when", default=None, help="the fault waits until this file exists too")
    parser.add_argument(
        "--pause-at", type=int, default=-1, help="every rank waits for --fail-when after this step"
    )
    parser.add_argument("--fail-wait-max-s", type=float, default=120.0, help="the longest --fail-when waits")
    parser.add_argument(
        "--memory-copy", action=argparse.BooleanOptionalAction, default=True, help="restore from memory"
    )
    parser.add_argument(
        "--memory-interval", default=None, help="memory-tier commits: auto or seconds (default: off)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log(args.log, ev="start", rank=rank, step=None)
    if args.resilient:
        import ettr
        from ettr.inplace import InPlaceConfig

        config = InPlaceConfig(
            rendezvous_timeout_s=args.rendezvous_timeout_s,
            collective_timeout_s=max(InPlaceConfig.collective_timeout_s, collective_timeout_s(args)),
        )
        result = ettr.resilient(lambda gen: train(gen.rank, gen.world_size, args, gen.index), config=config)()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout_s(args)))
        try:
            result = train(rank, world_size, args)
        finally:
            dist.destroy_process_group()
    log(args.log, ev="done", rank=rank, step=args.steps, digest=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
