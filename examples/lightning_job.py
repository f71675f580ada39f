"""A small Lightning job, fault tolerant the way Lightning's docs suggest, with ettr's one-line callback.

    ettr run --inject crash@step=35 -- python examples/lightning_job.py --ckpt-dir /tmp/lightning-ckpt
    ettr report runs/<job-id>

Under `ettr run` the callback line is optional (the bootstrap adds one to every Trainer); it is here to show
the explicit form, which also works with `ettr.init(RUN_DIR)` outside `ettr run`. See docs/lightning.md.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ettr.integrations.lightning import EttrCallback


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt-dir", default="lightning-ckpt")
    parser.add_argument("--num-steps", type=int, default=60)
    args = parser.parse_args()

    pl.seed_everything(0)
    x = torch.randn(2048, 32)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = pl.Trainer(
        max_steps=args.num_steps,
        accelerator="cpu",
        callbacks=[
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=10, save_last=True),
            EttrCallback(),  # the one line
        ],
        val_check_interval=20,
        limit_val_batches=4,
        logger=False,
        enable_progress_bar=False,
    )
    last = os.path.join(args.ckpt_dir, "last.ckpt")
    trainer.fit(
        Regression(),
        DataLoader(data, batch_size=32, shuffle=True),
        DataLoader(data, batch_size=64),
        ckpt_path="last" if os.path.exists(last) else None,
    )


if __name__ == "__main__":
    main()
