"""Time to recover: plain `torchrun --max-restarts 1` against `ettr run -- torchrun ...`, side by side.

The job (`benchmarks/jobs/recovery_job.py`, 2-rank gloo DDP, a checkpoint every 10 steps) fails once on rank 1 at
step 25 (`--faults`: crash = an exception, kill = SIGKILL, hang = blocks forever); the two launchers run
interleaved, `--trials` times each per fault. A recovery succeeded when the command exited 0 having trained
to the last step after the fault. TTR is measured the same way for both, from the job's own timestamps: the
fault to the first step completed by the next attempt. For ettr it also gives the ledger's parts
(`EttReport.ttr_parts`: detection, teardown, backoff, relaunch, imports, ..., first step), median per part.

    python benchmarks/recovery.py [--trials 3] [--faults crash,kill] [--json] [--quick]

`--quick` (what CI runs): one trial of each launcher on a crash.

`--json` ends with one object: per fault and launcher, trials, recovered, median and worst TTR (s), each
trial's TTR, and for ettr the median seconds per part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "jobs" / "recovery_job.py"
NUM_STEPS = 35


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _job_args(work: Path, fault: str) -> list[str]:
    return [
        str(JOB), "--ckpt-dir", str(work / "ckpt"), "--timings", str(work / "log.jsonl"),
        "--num-steps", str(NUM_STEPS), "--fault", fault,
    ]  # fmt: skip


def _torchrun(max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts)]  # fmt: skip


def _command(launcher: str, work: Path, fault: str, hang_timeout_s: float) -> list[str]:
    if launcher == "torchrun":
        return [*_torchrun(1), *_job_args(work, fault)]
    ettr = [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(work / "run"), "--max-restarts", "1"]
    if fault == "hang":
        ettr += ["--hang-timeout", f"{hang_timeout_s:g}"]
    return [*ettr, "--", *_torchrun(0), *_job_args(work, fault)]


def _measure(log: Path) -> tuple[bool, float | None]:
    """(trained to the last step after the fault, fault -> first step of the next attempt) from the log."""
    lines = (
        [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    )
    fault = next((e for e in lines if e["ev"] == "fault"), None)
    if fault is None:
        return False, None
    before = {e["pid"] for e in lines if e["ts"] <= fault["ts"]}
    after = [e for e in lines if e["ev"] == "step" and e["pid"] not in before]
    done = any(e["step"] == NUM_STEPS for e in after)
    first = min((e["ts"] for e in after), default=None)
    return done, None if first is None else first - fault["ts"]


def _ettr_parts(run_dir: Path) -> dict[str, float | None] | None:
    from ettr.report.load import read_run

    try:
        _, report = read_run(run_dir)
    except Exception as exc:
        _say(f"  cannot read {run_dir}: {exc}")
        return None
    if not report.ttr_parts:
        return None
    parts = dict(report.ttr_parts[0].parts_s)
    parts["total_s"] = report.ttr_parts[0].total_s
    return parts


def _trial(launcher: str, fault: str, timeout_s: float, hang_timeout_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ettr-recovery-{launcher}-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    try:
        proc = subprocess.run(
            _command(launcher, work, fault, hang_timeout_s),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
            check=False,
        )
        rc: int | None = proc.returncode
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"timed out after {timeout_s:g} s"]
    done, ttr = _measure(work / "log.jsonl")
    result = {"rc": rc, "recovered": rc == 0 and done, "ttr_s": ttr, "wall_s": time.monotonic() - started}
    if launcher == "ettr":
        result["parts_s"] = _ettr_parts(work / "run")
    if not result["recovered"]:
        result["why"] = tail[0] if tail else ""
    shutil.rmtree(work, ignore_errors=True)
    return result


def _summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ttrs = [t["ttr_s"] for t in trials if t["recovered"] and t["ttr_s"] is not None]
    out: dict[str, Any] = {
        "trials": len(trials),
        "recovered": sum(1 for t in trials if t["recovered"]),
        "median_ttr_s": statistics.median(ttrs) if ttrs else None,
        "worst_ttr_s": max(ttrs) if ttrs else None,
        "ttr_s": [None if t["ttr_s"] is None else round(t["ttr_s"], 3) for t in trials],
    }
    parts = [t["parts_s"] for t in trials if t.get("parts_s") and t["recovered"]]
    if parts:
        names = list(dict.fromkeys(n for p in parts for n in p))
        out["parts_median_s"] = {
            n: (
                round(statistics.median(vs), 3)
                if (vs := [p[n] for p in parts if p.get(n) is not None])
                else None
            )
            for n in names
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trials", type=int, default=3, help="trials per launcher and fault (10 for the issue)"
    )
    parser.add_argument("--faults", default="crash,kill", help="comma-separated: crash, kill, hang")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="a trial still running then failed")
    parser.add_argument("--hang-timeout-s", type=float, default=3.0, help="ettr run --hang-timeout for hang")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one crash trial per launcher (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.faults = 1, "crash"
    faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in faults if f not in ("crash", "kill", "hang")]
    if bad or args.trials < 1:
        print(
            f"recovery.py: bad --faults {bad} or --trials (crash, kill, hang; trials >= 1)", file=sys.stderr
        )
        return 2
    results: dict[str, dict[str, list[dict[str, Any]]]] = {f: {"torchrun": [], "ettr": []} for f in faults}
    for i in range(args.trials):
        for fault in faults:
            order = ("torchrun", "ettr") if i % 2 == 0 else ("ettr", "torchrun")  # interleaved
            for launcher in order:
                r = _trial(launcher, fault, args.timeout_s, args.hang_timeout_s)
                results[fault][launcher].append(r)
                ttr = "-" if r["ttr_s"] is None else f"{r['ttr_s']:.2f} s"
                why = "" if r["recovered"] else f" ({r.get('why', '')[:100]})"
                _say(f"trial {i} {fault:<5} {launcher:<8} recovered={r['recovered']} ttr={ttr}{why}")
    summary = {
        "benchmark": "recovery",
        "trials": args.trials,
        "faults": {f: {launcher: _summary(ts) for launcher, ts in by.items()} for f, by in results.items()},
        "quick": args.quick,
    }
    for fault, by in summary["faults"].items():
        for launcher, s in by.items():
            med = "-" if s["median_ttr_s"] is None else f"{s['median_ttr_s']:.2f} s"
            worst = "-" if s["worst_ttr_s"] is None else f"{s['worst_ttr_s']:.2f} s"
            print(
                f"{fault:<5} {launcher:<8} recovered {s['recovered']}/{s['trials']}  median TTR {med}  worst {worst}"
            )
            if "parts_median_s" in s:
                print(
                    "      parts (median s): " + ", ".join(f"{n} {v}" for n, v in s["parts_median_s"].items())
                )
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
