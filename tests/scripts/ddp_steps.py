"""Eight DDP steps over gloo, the rank from torchrun's `RANK` or, in a task of `srun python ddp_steps.py`, from
Slurm's `SLURM_PROCID` (as scripts that take their rank from Slurm do; no `RANK` there)."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(8):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
dist.destroy_process_group()
