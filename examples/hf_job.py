"""A small Hugging Face Trainer job (a tiny GPT-2 built from its config: nothing is downloaded), resuming
from its newest checkpoint as the HF docs suggest, with ettr's one-line callback.

    ettr run --inject crash@step=35 -- python examples/hf_job.py --out-dir /tmp/hf-out
    ettr report runs/<job-id>

Under `ettr run` the callback line is optional (the bootstrap adds one to every Trainer); it is here to show
the explicit form. See docs/huggingface.md.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from ettr.integrations.huggingface import EttrCallback  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_len: int = 32, vocab_size: int = 128) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", default="hf-out")
    parser.add_argument("--num-steps", type=int, default=60)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128))
    training_args = TrainingArguments(
        output_dir=args.out_dir,
        max_steps=args.num_steps,
        per_device_train_batch_size=8,
        save_steps=10,
        save_total_limit=3,
        eval_strategy="steps",
        eval_steps=20,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(1024),
        eval_dataset=RandomTokens(32),
        callbacks=[EttrCallback()],  # the one line
    )
    last = get_last_checkpoint(args.out_dir) if os.path.isdir(args.out_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
