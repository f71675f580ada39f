"""An ordinary Lightning training script (ettr appears only with `--explicit`, the one-line callback).

A tiny regression model; `ModelCheckpoint(every_n_train_steps=N, save_last=True)` and `fit(ckpt_path="last")`
as Lightning's docs suggest for fault tolerance; a short validation loop every `--val-every` steps. With
`--observe FILE` it appends what it saw (resumed step, each step's time, each checkpoint's step) for the
tests to compare with ettr's report. `--strategy ddp` under torchrun runs one process per rank (gloo).
"""

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from observed import Observed  # noqa: E402


class Regression(pl.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.step_s = step_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.step_s)
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Watch(pl.Callback):
    """The script's own view of its run (no ettr involved)."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed
        self.batch_start = 0.0

    def on_train_start(self, trainer, pl_module):
        self.observed.write("resumed", trainer.global_step or None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_start = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.observed.write("step", trainer.global_step, self.batch_start)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.observed.write("checkpoint", trainer.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--num-steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--observe")
    parser.add_argument("--explicit", action="store_true", help="add ettr's callback by hand")
    parser.add_argument("--async-save", action="store_true", help="AsyncCheckpointIO")
    parser.add_argument("--strategy", default="auto")
    args = parser.parse_args()
    observed = Observed(args.observe if int(os.environ.get("RANK", "0")) == 0 else None)

    pl.seed_everything(0)
    x = torch.randn(64 * 16, 16)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    train = DataLoader(data, batch_size=16, shuffle=True)
    val = DataLoader(data, batch_size=16)
    callbacks = [
        Watch(observed),
        ModelCheckpoint(
            dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_last=True, save_top_k=-1
        ),
    ]
    if args.explicit:
        from ettr.integrations.lightning import EttrCallback

        callbacks.append(EttrCallback())
    plugins = []
    if args.async_save:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    trainer = pl.Trainer(
        max_steps=args.num_steps,
        accelerator="cpu",
        devices="auto" if args.strategy == "auto" else int(os.environ.get("WORLD_SIZE", "1")),
        strategy=args.strategy,
        callbacks=callbacks,
        plugins=plugins,
        val_check_interval=args.val_every,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = os.path.join(args.ckpt_dir, "last.ckpt")
    trainer.fit(Regression(args.step_s), train, val, ckpt_path="last" if os.path.exists(last) else None)


if __name__ == "__main__":
    main()
