"""Writes what the process sees (attempt, argv, sys.path[0], __name__, a variable) to OUT.jsonl, then fails
in attempt 0 after one optimizer step (so that the supervisor restarts it without a back-off)."""

import json
import os
import sys

preloaded = "pytest" in sys.modules  # an installed package this script imports (a standby imports it ahead)
import pytest  # noqa: E402,F401
import torch  # noqa: E402

out = sys.argv[1]
with open(out, "a") as f:
    f.write(
        json.dumps(
            {
                "attempt": os.environ.get("ETTR_ATTEMPT"),
                "argv": sys.argv,
                "path0": sys.path[0],
                "name": __name__,
                "pid": os.getpid(),
                "probe": os.environ.get("PROBE"),
                "preloaded": preloaded,
                "policy": os.sched_getscheduler(0),
            }
        )
        + "\n"
    )
time_before = float(os.environ.get("PROBE_BEFORE_S", "0"))  # a longer start-up before the first step
if time_before and os.environ.get("ETTR_ATTEMPT") == "0":
    import time

    time.sleep(time_before)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(1, 2)).sum().backward()
opt.step()
if os.environ.get("ETTR_ATTEMPT") == "0":
    import time

    time.sleep(float(os.environ.get("PROBE_WAIT_S", "3")))  # long enough for the standby to start
    raise SystemExit(3)
