"""Two ranks that know nothing of ettr and save ONE checkpoint path at different steps (tests/test_resume_attribution.py).

Attempt 0: rank 0 saves at step 2; then rank 1 (later) saves at step 4 over it and is SIGKILLed at once, as an
agent kills a rank before its books are delivered; rank 0 then fails. Attempt 1: both ranks load the file and
train on. The saved objects carry no step key, so only the save hooks can say which step the file holds.
Usage: train_shared_ckpt.py OUT_DIR CKPT
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch


def wait_for(path: Path) -> None:
    deadline = time.time() + 120
    while not path.exists():
        if time.time() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.05)


def main() -> None:
    out, ckpt = Path(sys.argv[1]), sys.argv[2]
    rank, attempt = int(os.environ["RANK"]), int(os.environ["ETTR_ATTEMPT"])
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()

    if attempt > 0:
        state = torch.load(ckpt)
        (out / f"loaded-{attempt}-{rank}").write_text(str(state["writer"]))
        for _ in range(2):
            step()
        return
    save_at = 2 if rank == 0 else 4
    if rank == 1:
        wait_for(out / "r0_saved")
    for _ in range(save_at):
        step()
    tmp = f"{ckpt}.tmp{rank}"
    torch.save({"model": model.state_dict(), "writer": f"rank {rank} at step {save_at}"}, tmp)
    os.replace(tmp, ckpt)
    (out / f"r{rank}_saved").write_text("")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for(out / "r1_saved")
    sys.exit(1)


if __name__ == "__main__":
    main()
