"""What the zero-code bootstrap costs a script, measured side by side in one run.

1. Interpreter start-up (`python -c pass`, median of `--starts` runs each): plain; with the bootstrap on
   PYTHONPATH but outside a run; as a child of an instrumented process (data loader / compile worker: the
   marker says skip); and as an instrumented training process (recorder, heartbeat, lazy torch hooks).
   Then `python -c "import torch"` plain and instrumented (`--torch-starts` each): most of what the bootstrap
   imports, torch imports anyway.
2. Per call, in this process, hooks installed vs not (median of `--runs` blocks of `--calls` calls):
   `optimizer.step()` of a tiny model (the step hook), `torch.save` to a BytesIO (a pass-through),
   `model.train()` of a 48-module model (what a Hugging Face Trainer calls every step: never wrapped outside
   an evaluation) and one evaluation of it (`eval()`, two forward passes under no_grad, `train()`: the
   zero-code evaluation hooks' cost per evaluation, off the training steps).

`--json` ends with one object: startup_plain_s, startup_outside_run_s, startup_worker_s,
startup_instrumented_s, import_torch_plain_s, import_torch_instrumented_s, import_torch_overhead_ratio,
optimizer_step_plain_us, optimizer_step_hooked_us, step_hook_overhead_us,
save_bytesio_plain_us, save_bytesio_hooked_us, save_hook_overhead_us, module_train_plain_us,
module_train_hooked_us, module_train_overhead_us, evaluation_plain_us, evaluation_hooked_us,
evaluation_overhead_us, quick. `--quick` (what CI runs): 2 starts, 1 torch start, 1 block of 200 calls: the
same figures, noisier.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ettr.bootstrap import pythonpath_dir


def _start_s(env: dict[str, str], code: str = "pass") -> float:
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - begin


def _per_call_us(fn, num_calls: int, num_runs: int) -> float:  # type: ignore[no-untyped-def]
    blocks = []
    for _ in range(num_runs):
        begin = time.perf_counter()
        for _ in range(num_calls):
            fn()
        blocks.append((time.perf_counter() - begin) / num_calls * 1e6)
    return statistics.median(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=7)
    parser.add_argument("--torch-starts", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="a few starts and calls (CI's check that it runs)"
    )
    args = parser.parse_args()
    if args.quick:
        args.starts, args.torch_starts, args.calls, args.runs = 2, 1, 200, 1
    if min(args.starts, args.torch_starts, args.runs) < 1 or args.calls < 8:
        parser.error("--starts, --torch-starts and --runs must be >= 1, --calls >= 8")

    base = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        outside = {**base, "PYTHONPATH": str(pythonpath_dir())}
        inside = {**outside, "ETTR_RUN_DIR": str(run_dir), "ETTR_ATTEMPT": "0", "ETTR_AUTO": "1"}
        worker = {**inside, "ETTR_INSTRUMENTED_PID": "1"}
        # Interleave the variants so that load on the shared machine hits them alike.
        results: dict[str, list[float]] = {"plain": [], "outside": [], "worker": [], "instrumented": []}
        for _ in range(args.starts):
            for name, env in (
                ("plain", base),
                ("outside", outside),
                ("worker", worker),
                ("instrumented", inside),
            ):
                results[name].append(_start_s(env))
        startup = {name: statistics.median(v) for name, v in results.items()}
        torch_plain, torch_inside = [], []
        for _ in range(args.torch_starts):
            torch_plain.append(_start_s(base, "import torch"))
            torch_inside.append(_start_s(inside, "import torch"))
        startup["torch_plain"] = statistics.median(torch_plain)
        startup["torch_instrumented"] = statistics.median(torch_inside)

        import torch

        from ettr.bootstrap.hooks import AutoHooks
        from ettr.ledger import open_ledger
        from ettr.recorder import Recorder

        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        state = {"w": torch.zeros(4)}

        def save() -> None:
            torch.save(state, io.BytesIO())

        net = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(16))
        )
        net_optimizer = torch.optim.SGD(net.parameters(), lr=0.0)  # built before the hooks: registered below
        batch = torch.zeros(2, 8)

        def train_mode() -> None:
            net.train()

        def evaluation() -> None:
            net.eval()
            with torch.no_grad():
                net(batch)
                net(batch)
            net.train()

        rec = Recorder(open_ledger(Path(tmp) / "bench"), run_dir=Path(tmp) / "bench")
        hooks = AutoHooks(rec)
        names = ("step", "save", "train", "evaluation")
        timings: dict[str, list[float]] = {k: [] for name in names for k in (name, f"{name}_hooked")}
        try:
            for _ in range(args.runs):  # plain and hooked blocks alternate, so load hits both alike
                timings["step"].append(_per_call_us(optimizer.step, args.calls, 1))
                timings["save"].append(_per_call_us(save, args.calls // 4, 1))
                timings["train"].append(_per_call_us(train_mode, args.calls // 4, 1))
                timings["evaluation"].append(_per_call_us(evaluation, args.calls // 8, 1))
                hooks = AutoHooks(rec)
                hooks.on_torch(torch)
                evals = getattr(hooks, "evals", None)  # the evaluation hooks (an ettr that has them)
                if evals is not None:
                    evals.trained.add(net_optimizer)
                timings["step_hooked"].append(_per_call_us(optimizer.step, args.calls, 1))
                timings["save_hooked"].append(_per_call_us(save, args.calls // 4, 1))
                timings["train_hooked"].append(_per_call_us(train_mode, args.calls // 4, 1))
                timings["evaluation_hooked"].append(_per_call_us(evaluation, args.calls // 8, 1))
                hooks.uninstall()
        finally:
            hooks.uninstall()
            rec.close()
        step_plain, step_hooked, save_plain, save_hooked = (
            statistics.median(timings[k]) for k in ("step", "step_hooked", "save", "save_hooked")
        )
        train_plain, train_hooked, eval_plain, eval_hooked = (
            statistics.median(timings[k])
            for k in ("train", "train_hooked", "evaluation", "evaluation_hooked")
        )

    figures = {
        "startup_plain_s": startup["plain"],
        "startup_outside_run_s": startup["outside"],
        "startup_worker_s": startup["worker"],
        "startup_instrumented_s": startup["instrumented"],
        "import_torch_plain_s": startup["torch_plain"],
        "import_torch_instrumented_s": startup["torch_instrumented"],
        "import_torch_overhead_ratio": startup["torch_instrumented"] / startup["torch_plain"],
        "optimizer_step_plain_us": step_plain,
        "optimizer_step_hooked_us": step_hooked,
        "step_hook_overhead_us": step_hooked - step_plain,
        "save_bytesio_plain_us": save_plain,
        "save_bytesio_hooked_us": save_hooked,
        "save_hook_overhead_us": save_hooked - save_plain,
        "module_train_plain_us": train_plain,
        "module_train_hooked_us": train_hooked,
        "module_train_overhead_us": train_hooked - train_plain,
        "evaluation_plain_us": eval_plain,
        "evaluation_hooked_us": eval_hooked,
        "evaluation_overhead_us": eval_hooked - eval_plain,
        "quick": args.quick,
    }
    print("interpreter start-up (median)")
    print(f"  plain python                      {startup['plain'] * 1e3:8.1f} ms")
    print(f"  bootstrap on path, outside a run  {startup['outside'] * 1e3:8.1f} ms")
    print(f"  child of an instrumented process  {startup['worker'] * 1e3:8.1f} ms")
    print(f"  instrumented training process     {startup['instrumented'] * 1e3:8.1f} ms")
    print(f"  'import torch', plain             {startup['torch_plain'] * 1e3:8.1f} ms")
    print(
        f"  'import torch', instrumented      {startup['torch_instrumented'] * 1e3:8.1f} ms"
        f"  (x{startup['torch_instrumented'] / startup['torch_plain']:.3f}, hooks installed at import)"
    )
    print("per call (median)                plain    hooked   overhead")
    print(
        f"  optimizer.step()            {step_plain:8.2f} us {step_hooked:8.2f} us {step_hooked - step_plain:8.2f} us"
    )
    print(
        f"  torch.save(BytesIO)         {save_plain:8.2f} us {save_hooked:8.2f} us {save_hooked - save_plain:8.2f} us"
    )
    print(
        f"  model.train() (48 modules)  {train_plain:8.2f} us {train_hooked:8.2f} us {train_hooked - train_plain:8.2f} us"
    )
    print(
        f"  one evaluation              {eval_plain:8.2f} us {eval_hooked:8.2f} us {eval_hooked - eval_plain:8.2f} us"
    )
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
