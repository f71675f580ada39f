"""The job of `benchmarks/recovery.py`: 2-rank gloo DDP that fails once on rank 1 at `--fail-at` and logs its
own timestamps (so a plain torchrun run, which has no ledger, is timed the same way as an `ettr run`).

It knows nothing of ettr. Rank 0 saves `CKPT_DIR/step-N.pt` every `--save-every` steps; every rank resumes
from the newest one. The fault fires once per trial (a marker file beside the log): `crash` raises,
`kill` SIGKILLs the rank, `hang` blocks it forever (the process group's timeout, `--pg-timeout-s`, is what
lets a plain torchrun notice). Each line of `--timings` is JSON: {"ev": "start"|"step"|"fault", "ts", "rank",
"step", "pid"}.
"""

import argparse
import datetime
import json
import os
import re
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def log(path: str, **fields: object) -> None:
    line = json.dumps({"ts": time.time(), "pid": os.getpid(), **fields})
    with open(path, "a") as f:  # one short O_APPEND write per line: lines of the ranks never interleave
        f.write(line + "\n")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    found = [(int(m.group(1)), n) for n in os.listdir(ckpt_dir) if (m := re.fullmatch(r"step-(\d+)\.pt", n))]
    return os.path.join(ckpt_dir, max(found)[1]) if found else None


def fire(kind: str, args: argparse.Namespace, rank: int, step: int) -> None:
    marker = args.timings + ".fired"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # once per trial
    log(args.timings, ev="fault", rank=rank, step=step, kind=kind)
    if kind == "crash":
        raise RuntimeError(f"injected crash at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--timings", required=True)
    parser.add_argument("--num-steps", type=int, default=35)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--fail-at", type=int, default=25)
    parser.add_argument("--fault", choices=("crash", "kill", "hang"), default="crash")
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--pg-timeout-s", type=float, default=20.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    log(args.timings, ev="start", rank=rank, step=None)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    dist.barrier()
    path = latest_checkpoint(args.ckpt_dir)
    if path is not None:
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    generator = torch.Generator().manual_seed(rank)
    for step in range(start, args.num_steps):
        x = torch.randn(16, 8, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        time.sleep(args.step_s)
        optimizer.step()
        done = step + 1
        log(args.timings, ev="step", rank=rank, step=done)
        if rank == 1 and done == args.fail_at:
            fire(args.fault, args, rank, done)
        if done % args.save_every == 0:
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": done,
                }
                tmp = os.path.join(args.ckpt_dir, f".step-{done}.pt.tmp")
                torch.save(state, tmp)
                os.replace(tmp, os.path.join(args.ckpt_dir, f"step-{done}.pt"))
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
