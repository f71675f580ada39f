"""What the reference job costs here: TorchRec import, planning, sharding, compile, a step; and the audit.

    python examples/dlrm/bench.py [--steps 200] [--repeats 2] [--json]

Runs, side by side in one go: the import of torch and of TorchRec in fresh interpreters (median of
three), the 2-rank job compiled and eager, alternating (start-up parts as the job measures them, median
step time, loss), and the cost of one `torch.distributed.all_reduce` on a 1-rank gloo group plain, under
the init communication audit, and after the audit ended (median per call over interleaved rounds).
With `--json` the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def import_seconds(statement: str, *, before: str = "", repeats: int = 3) -> float:
    """Median seconds of `statement` in a fresh interpreter (after `before`, which is not timed)."""
    code = f"{before}\nimport time\nt = time.perf_counter()\n{statement}\nprint(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) for _ in range(repeats)]  # fmt: skip
    return statistics.median(runs)


def run_job(steps: int, *, compile: bool, workdir: Path) -> dict:
    """One 2-rank run of train.py; returns rank 0's summary plus the wall time of the whole launch."""
    summary_path = workdir / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(HERE / "train.py"), "--steps", str(steps), "--log-every", str(max(1, steps // 4)), "--no-resume",
        "--compile" if compile else "--no-compile", "--summary-out", str(summary_path),
    ]  # fmt: skip
    begin = time.perf_counter()
    subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    summary = json.loads(summary_path.read_text())
    summary["launch_wall_s"] = time.perf_counter() - begin
    return summary


def audit_overhead(num_rounds: int = 15, calls_per_round: int = 200) -> dict[str, float]:
    """Median microseconds per all_reduce: plain, audited, and after the audit ended (interleaved rounds)."""
    import torch
    import torch.distributed as dist

    from ettr.audit import CommAudit
    from ettr.recorder import NullRecorder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(1)

    def per_call_us() -> float:
        begin = time.perf_counter()
        for _ in range(calls_per_round):
            dist.all_reduce(tensor)
        return (time.perf_counter() - begin) / calls_per_round * 1e6

    plain, audited, after = [], [], []
    for _ in range(num_rounds):
        plain.append(per_call_us())
        audit = CommAudit(NullRecorder()).install()
        audited.append(per_call_us())
        audit.finish()
        after.append(per_call_us())
    dist.destroy_process_group()
    return {
        "all_reduce_plain_us": statistics.median(plain),
        "all_reduce_audited_us": statistics.median(audited),
        "all_reduce_after_audit_us": statistics.median(after),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each job run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of all figures")
    args = parser.parse_args()

    figures: dict[str, float] = {}
    figures["import_torch_s"] = import_seconds("import torch")
    figures["import_torchrec_after_torch_s"] = import_seconds("import torchrec", before="import torch")
    runs: dict[str, list[dict]] = {"compiled": [], "eager": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternating, so that load on the shared machine hits both alike
            for name in runs:
                runs[name].append(run_job(args.steps, compile=name == "compiled", workdir=Path(tmp)))
    for name, jobs in runs.items():
        for part in (
            "torchrec_import",
            "plan",
            "shard",
            "train_module_creation",
            "compile",
            "get_first_batch_data",
        ):
            if part in jobs[0]["init_s"]:
                figures[f"{name}_{part}_s"] = statistics.median(job["init_s"][part] for job in jobs)
        figures[f"{name}_median_step_ms"] = statistics.median(job["median_step_s"] for job in jobs) * 1000
        figures[f"{name}_first_loss"] = jobs[0]["window_losses"][0]
        figures[f"{name}_last_loss"] = jobs[0]["window_losses"][-1]
        figures[f"{name}_audit_calls"] = jobs[0]["audit"]["num_calls"]
        figures[f"{name}_audit_comm_s"] = statistics.median(job["audit"]["total_s"] for job in jobs)
        figures[f"{name}_launch_wall_s"] = statistics.median(job["launch_wall_s"] for job in jobs)
    figures["step_ratio_compiled_over_eager"] = (
        figures["compiled_median_step_ms"] / figures["eager_median_step_ms"]
    )
    figures.update(audit_overhead())
    figures["audit_ratio_audited_over_plain"] = (
        figures["all_reduce_audited_us"] / figures["all_reduce_plain_us"]
    )
    figures["audit_ratio_after_over_plain"] = (
        figures["all_reduce_after_audit_us"] / figures["all_reduce_plain_us"]
    )

    print(
        f"TorchRec reference job, {args.steps} steps, 2 ranks over gloo, {args.repeats} runs of each, "
        "alternating (medians; this machine, side by side)"
    )
    print(f"  import torch                  {figures['import_torch_s']:.2f} s")
    print(f"  import torchrec (after torch) {figures['import_torchrec_after_torch_s']:.2f} s")
    for name in runs:
        parts = ", ".join(
            f"{part} {figures[f'{name}_{part}_s']:.2f}s"
            for part in ("torchrec_import", "plan", "shard", "compile", "get_first_batch_data")
            if f"{name}_{part}_s" in figures
        )
        print(f"  {name:8} start-up: {parts}")
        print(
            f"  {name:8} step {figures[f'{name}_median_step_ms']:.1f} ms, loss {figures[f'{name}_first_loss']:.3f}"
            f" -> {figures[f'{name}_last_loss']:.3f}, start-up collectives {figures[f'{name}_audit_calls']:.0f}"
            f" in {figures[f'{name}_audit_comm_s'] * 1000:.0f} ms, launch {figures[f'{name}_launch_wall_s']:.1f} s"
        )
    print(f"  step time compiled / eager   {figures['step_ratio_compiled_over_eager']:.2f}")
    print(
        f"  all_reduce (1 rank): plain {figures['all_reduce_plain_us']:.1f} us, audited "
        f"{figures['all_reduce_audited_us']:.1f} us ({figures['audit_ratio_audited_over_plain']:.2f}x), after the audit "
        f"{figures['all_reduce_after_audit_us']:.1f} us ({figures['audit_ratio_after_over_plain']:.2f}x)"
    )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
