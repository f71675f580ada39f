"""A 2-rank gloo worker that writes what it sees (torchrun's variables, pid) to OUT/ATTEMPT-RANK.json; in
attempt 0, rank 1 exits 3 after one optimizer step while rank 0 sleeps (the agent must stop it)."""

import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
    "TORCHELASTIC_ERROR_FILE", "ETTR_ATTEMPT", "TORCHINDUCTOR_CACHE_DIR",
)  # fmt: skip

out = sys.argv[1]
attempt, rank = os.environ["ETTR_ATTEMPT"], os.environ["RANK"]
seen = {name: os.environ.get(name) for name in NAMES}
with open(os.path.join(out, f"{attempt}-{rank}.json"), "w") as f:
    json.dump({"env": seen, "pid": os.getpid(), "argv": sys.argv, "name": __name__}, f)
dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(1, 2)).sum().backward()
opt.step()
if attempt == "0":
    if rank == "1":
        raise SystemExit(3)
    import time

    time.sleep(120)  # stopped by the agent once rank 1 is gone
dist.barrier()
dist.destroy_process_group()
