"""An ordinary PyTorch training script that knows nothing of ettr (the tests run it unmodified).

A linear model trained with SGD; `torch.save` every `--save-every` steps to `CKPT_DIR/step-N.pt` (or to a
temporary file renamed into place with `--atomic`); at start, resume from the newest checkpoint there.
Sleeps of known length stand in for the phases: `--init-s` before the model is built, `--first-batch-s` in
the data set's first item, `--step-s` per step.
"""

import argparse
import os
import re
import time

import torch
from torch.utils.data import DataLoader, Dataset


class SlowStartData(Dataset):
    def __init__(self, first_batch_s: float) -> None:
        self.first_batch_s = first_batch_s
        self.generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, 16, generator=self.generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.first_batch_s:
            time.sleep(self.first_batch_s)
            self.first_batch_s = 0.0
        return self.x[i], self.y[i]


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
    parser.add_argument("--num-steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--init-s", type=float, default=0.2)
    parser.add_argument("--first-batch-s", type=float, default=0.2)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--atomic", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)

    time.sleep(args.init_s)  # stands in for building a big model
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    path = latest_checkpoint(args.ckpt_dir)
    if path is not None:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from {path} at step {start}", flush=True)

    batches = iter(DataLoader(SlowStartData(args.first_batch_s), batch_size=32, shuffle=False))
    for step in range(start, args.num_steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        time.sleep(args.step_s)  # stands in for a bigger model's forward and backward
        optimizer.step()
        done = step + 1
        if done % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done}
            final = os.path.join(args.ckpt_dir, f"step-{done}.pt")
            if args.atomic:
                torch.save(state, final + ".tmp")
                os.replace(final + ".tmp", final)
            else:
                torch.save(state, final)
    print(f"trained to step {args.num_steps}; loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
