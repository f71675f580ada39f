"""An ordinary 2-process DDP (gloo) training script for torchrun that knows nothing of ettr.

Rank 0 saves `CKPT_DIR/step-N.pt` every `--save-every` steps; every rank resumes from the newest one at
start. `--step-s` sleeps stand in for compute. Ends with a barrier before destroying the process group.
"""

import argparse
import os
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def latest_checkpoint(ckpt_dir: str) -> str | None:
    found = []
    for name in os.listdir(ckpt_dir):
        match = re.fullmatch(r"step-(\d+)\.pt", name)
        if match:
            found.append((int(match.group(1)), os.path.join(ckpt_dir, name)))
    return max(found)[1] if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
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
        time.sleep(args.step_s)  # stands in for a bigger model's compute
        optimizer.step()
        done = step + 1
        if done % args.save_every == 0:
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": done,
                }
                torch.save(state, os.path.join(args.ckpt_dir, f"step-{done}.pt"))
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"trained to step {args.num_steps}", flush=True)


if __name__ == "__main__":
    main()
