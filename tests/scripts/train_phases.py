"""A training script whose phases take times given on its command line (for fleet tests).

Compiles (sleeps inside `ettr.phase(COMPILE)`) for `--compile-s`, then runs `--steps` steps of
`--step-s`, committing a checkpoint every `--commit-every` steps (0: never). With `--hold-s` it then stays
alive without training (a running job a scheduler may preempt), after touching `--ready-file`.
"""

import argparse
import os
import pathlib
import time

import ettr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-s", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--commit-every", type=int, default=0)
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--ready-file")
    args = parser.parse_args()
    with ettr.phase(ettr.Phase.COMPILE):
        time.sleep(args.compile_s)
    for n in range(1, args.steps + 1):
        time.sleep(args.step_s)
        ettr.step(n)
        if args.commit_every and n % args.commit_every == 0:
            ettr.checkpoint_committed(n, f"ckpt/step-{n}")
    ettr.get_recorder().flush()
    if args.ready_file:
        pathlib.Path(args.ready_file).write_text(os.environ.get("ETTR_FAMILY", ""))
    time.sleep(args.hold_s)


if __name__ == "__main__":
    main()
