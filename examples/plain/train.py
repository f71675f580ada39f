"""A plain PyTorch job that knows nothing of ettr: `ettr run -- python examples/plain/train.py`.

It trains a small MLP on synthetic data, saves a checkpoint every `--save-every` steps (to a temporary file,
renamed into place, so a crash mid-save never leaves a half-written checkpoint) and resumes from it when it
starts again, which is all `ettr run` needs to restart it after a failure and to tell kept from lost work.
Under torchrun (`WORLD_SIZE` > 1) it is a DistributedDataParallel job over gloo: every rank resumes from the
same checkpoint, rank 0 writes it. (Independent trainers sharing one checkpoint file would race: a rank that
starts late resumes from what a faster one already finished.)
"""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--ckpt", default="checkpoints/plain.pt")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    start = 0
    if os.path.exists(args.ckpt):  # resume: ettr sees this load and records the step it resumes from
        state = torch.load(args.ckpt)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    torch.manual_seed(1 + rank)  # each rank its own data
    loss = None  # a resume at the last step trains nothing
    for step in range(start, args.steps):
        x = torch.randn(256, 32)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # ettr counts optimizer steps as training steps
        if (step + 1) % args.save_every == 0 and rank == 0:
            os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            tmp = f"{args.ckpt}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, args.ckpt)  # the checkpoint is complete only now
    done = (
        f"trained steps {start + 1}-{args.steps}"
        if start < args.steps
        else f"resumed at step {start}: trained none"
    )
    print(done + ("" if loss is None else f", loss {loss.item():.4f}"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
