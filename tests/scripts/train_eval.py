"""A training script shaped like nanoGPT's train.py that knows nothing of ettr: evaluation inside the loop.

At the top of every `--eval-every`-th iteration (iteration 0 too, and again right after a resume, as nanoGPT
does): `model.eval()`, `--eval-iters` forward passes under `torch.no_grad()`, `model.train()`; then, every
`--save-every` iterations, the training state to one file (`--ckpt`, overwritten in place as nanoGPT does).
At start it resumes from that file if it exists. The loop ends at the top of iteration `--num-steps`, after
its evaluation: the job's final evaluation. With `--final-eval-in-eval-mode` that one never switches back
(pytorch/examples' mnist ends in eval mode). With `--eval-in-train-mode` the evaluation never leaves train mode:
it runs a validation DataLoader through the training model, each batch under `torch.set_grad_enabled(False)`
(pytorch/examples' distributed/minGPT-ddp). Sleeps stand in for a bigger model (`--step-s` per step,
`--pass-s` per evaluation pass); `--data` names a tensor of inputs, loaded at start with torch.load.

`--observe FILE` appends what the script's own clock saw: "resumed", each "step" (t0: its start after the
evaluation and save, t1: after optimizer.step), each "eval" (t0 before eval(), t1 after train(); step: the
iteration it evaluated), its "eval_passes" (from before the first pass to the start of the last forward call: inside any span that
covers the passes), each "checkpoint".
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from observed import Observed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--pass-s", type=float, default=0.05)
    parser.add_argument("--final-eval-in-eval-mode", action="store_true")
    parser.add_argument("--eval-in-train-mode", action="store_true")
    parser.add_argument(
        "--save-model",
        help="at the end, torch.save the whole model (still in eval mode with --final-eval-in-eval-mode)",
    )
    parser.add_argument("--data", help="a tensor of inputs saved with torch.save, loaded at start")
    parser.add_argument("--observe")
    args = parser.parse_args()
    observed = Observed(args.observe)

    torch.manual_seed(0)
    inputs = torch.load(args.data) if args.data else torch.randn(64, 16)  # data, not a checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    val_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(args.eval_iters * 8, 16)), batch_size=8
    )
    iter_num = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        iter_num = state["iter_num"]
        observed.write("resumed", iter_num)

    def evaluate(last: bool) -> None:
        if args.eval_in_train_mode:
            begin = time.time()
            batches = iter(val_loader)
            first = time.time()
            for (x,) in batches:
                with torch.set_grad_enabled(False):
                    time.sleep(args.pass_s)
                    last_pass = time.time()
                    model(x)
            observed.write("eval", iter_num, begin, time.time())
            observed.write("eval_passes", iter_num, first, last_pass)
            return
        begin = time.time()
        model.eval()
        with torch.no_grad():
            first = time.time()
            for _ in range(args.eval_iters):
                time.sleep(args.pass_s)
                last_pass = time.time()
                model(torch.randn(8, 16))
        if not (last and args.final_eval_in_eval_mode):
            model.train()
        observed.write("eval", iter_num, begin, time.time())
        observed.write("eval_passes", iter_num, first, last_pass)

    while True:
        last = iter_num >= args.num_steps
        if iter_num % args.eval_every == 0 or last:
            evaluate(last)
        if iter_num > 0 and iter_num % args.save_every == 0 and not last:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
            torch.save(state, args.ckpt)
            observed.write("checkpoint", iter_num)
        if last:
            break
        begin = time.time()
        x = inputs[torch.randint(len(inputs), (8,))]
        loss = model(x).pow(2).mean()
        loss.backward()
        time.sleep(args.step_s)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        observed.write("step", iter_num, begin)
    if args.save_model:
        torch.save(model, args.save_model)  # the whole module, as image-classification examples do
    print(f"trained to iteration {iter_num}", flush=True)


if __name__ == "__main__":
    main()
