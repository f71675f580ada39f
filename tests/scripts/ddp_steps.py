"""Eight DDP steps over gloo, the rank from torchrun's `RANK` or, in a task of `srun python ddp_steps.py`, from
Slurm's `SLURM_PROCID` (as scripts that take their rank from Slurm do; no `RANK` there), or, under `mpirun`,
from Open MPI's `OMPI_COMM_WORLD_RANK` (`MASTER_ADDR`/`MASTER_PORT` from the environment)."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # `mpirun -np 2 python ddp_steps.py`
        rank, world_size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
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
