"""The same job with the ettr API: phases named by the script, steps counted by it, runnable with or
without `ettr run` (alone it records into runs/plain-api through `ettr.init`)."""

import os
import time

import torch

import ettr

if "ETTR_RUN_DIR" not in os.environ:  # not under `ettr run`: record into a run directory of our own
    ettr.init("runs/plain-api")

with ettr.phase(ettr.Phase.INIT):  # model build, process groups, ...: the report's `init` bucket
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with ettr.phase(ettr.Phase.GET_FIRST_BATCH_DATA):  # waiting for the first batch: `data_wait`
    time.sleep(0.2)  # stands in for a data loader's warm-up
ettr.training_started()
for step in range(200):
    x = torch.randn(256, 32)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ettr.step(step + 1)  # the global step just completed: ~2 us, never raises
print(f"loss {loss.item():.4f}; report: ettr report {ettr.get_recorder().run_dir}")
