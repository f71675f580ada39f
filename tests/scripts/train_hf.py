"""An ordinary Hugging Face Trainer script (ettr appears only with `--explicit`, the one-line callback).

A one-layer GPT-2 built from its config (nothing downloaded) trained on random tokens; `save_steps=N`, a
short evaluation every `--eval-every` steps, and `train(resume_from_checkpoint=<newest checkpoint>)` when
one exists, as the HF docs suggest. With `--observe FILE` it appends what it saw (resumed step, each step's
time, each checkpoint's step) for the tests to compare with ettr's report.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from observed import Observed  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Watch(TrainerCallback):
    """The script's own view of its run (no ettr involved)."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed
        self.step_start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.observed.write("resumed", state.global_step or None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.time()

    def on_optimizer_step(self, args, state, control, **kwargs):
        # The optimizer step itself (global_step counts it just after): seen whatever order the callbacks run
        # in; ettr's runs first and an injected fault ends the process in its `on_step_end`.
        self.observed.write("step", state.global_step + 1, self.step_start)

    def on_save(self, args, state, control, **kwargs):
        self.observed.write("checkpoint", state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--observe")
    parser.add_argument("--explicit", action="store_true", help="add ettr's callback by hand")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64))

    def slow(module, inputs):  # stands in for a real step's compute
        if module.training:
            time.sleep(args.step_s)

    model.register_forward_pre_hook(slow)
    callbacks = [Watch(Observed(args.observe))]
    if args.explicit:
        from ettr.integrations.huggingface import EttrCallback

        callbacks.append(EttrCallback())
    training_args = TrainingArguments(
        output_dir=args.out_dir,
        max_steps=args.num_steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        save_steps=args.save_every,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Tokens(512),
        eval_dataset=Tokens(16),
        callbacks=callbacks,
    )
    last = get_last_checkpoint(args.out_dir) if os.path.isdir(args.out_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
