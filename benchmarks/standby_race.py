"""A restart never waits on a cold standby: `ettr run`'s default restart path (warm standbys) against
`ETTR_STANDBY=0`, side by side, on a busy machine and on a quiet one.

The job (`benchmarks/jobs/recovery_job.py`, 2-rank gloo DDP under ettr's own torchrun agent, a checkpoint every
10 steps) trains for `--train-s` seconds (its steps sleep, as a GPU job's CPU does) and then fails once on
rank 1 (`crash`: an exception). Its standbys start at its first step, at SCHED_IDLE. `busy` runs
`--busy` extra CPU-bound processes beside it (two by default: on this 2-core machine the standbys then get
no CPU before the crash, and the restart promotes them); `quiet` runs none. The two modes run interleaved
(the order alternates), `--trials` times each per condition. TTR is measured from the job's own
timestamps: the fault to the first step of the next attempt (as `benchmarks/recovery.py` does); the
report of each `ettr run` gives the relaunch path (warm | promoted | cold) and its parts.

    python benchmarks/standby_race.py [--trials 5] [--conditions busy,quiet] [--busy 2] [--quick] [--json]

`--json` ends with one object: per condition, per mode the median, worst and every trial's TTR (s), the
relaunch paths seen and the median relaunch and imports parts; `ratio` = median TTR with standbys / with
standbys off (<= 1: the default path is no slower), and `standby_no_slower` (ratio <= 1).
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
MODES = ("standby", "off")
STEP_S = 0.05


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _command(work: Path, fail_at: int) -> list[str]:
    return [
        sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(work / "run"), "--max-restarts", "1", "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(JOB), "--ckpt-dir", str(work / "ckpt"), "--timings", str(work / "log.jsonl"),
        "--num-steps", str(fail_at + 10), "--save-every", "10", "--fail-at", str(fail_at),
        "--fault", "crash", "--step-s", str(STEP_S),
    ]  # fmt: skip


def _ttr(log: Path, num_steps: int) -> tuple[bool, float | None]:
    """(trained to the last step after the fault, fault -> first step of a process started after it)."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    fault = next((e for e in lines if e["ev"] == "fault"), None)
    if fault is None:
        return False, None
    before = {e["pid"] for e in lines if e["ts"] <= fault["ts"]}
    after = [e for e in lines if e["ev"] == "step" and e["pid"] not in before]
    first = min((e["ts"] for e in after), default=None)
    return any(e["step"] == num_steps for e in after), None if first is None else first - fault["ts"]


def _relaunch(run_dir: Path) -> dict[str, Any]:
    """The recovery's relaunch path and parts, from the run's report."""
    from ettr.report.load import read_run

    try:
        _, report = read_run(run_dir)
    except Exception as exc:
        return {"path": None, "why": f"cannot read the run: {exc}"}
    if not report.ttr_parts:
        return {"path": None, "why": "no recovery in the report"}
    parts = report.ttr_parts[0]
    return {
        "path": parts.relaunch_path,
        "why": parts.relaunch_why,
        "relaunch_s": parts.parts_s.get("relaunch"),
        "imports_s": parts.parts_s.get("imports"),
    }


def _trial(mode: str, fail_at: int, timeout_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ettr-standby-race-{mode}-"))
    env = {k: v for k, v in os.environ.items() if k not in ("ETTR_STANDBY", "OMP_NUM_THREADS")}
    if mode == "off":
        env["ETTR_STANDBY"] = "0"
    try:
        proc = subprocess.run(
            _command(work, fail_at), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            timeout=timeout_s, check=False,
        )  # fmt: skip
        rc: int | None = proc.returncode
        said = proc.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        rc, said = None, f"timed out after {timeout_s:g} s"
    done, ttr = _ttr(work / "log.jsonl", fail_at + 10)
    result: dict[str, Any] = {"rc": rc, "recovered": rc == 0 and done, "ttr_s": ttr}
    result.update(_relaunch(work / "run"))
    result["waited_said"] = "waiting for the standby" in said
    if not result["recovered"]:
        result["tail"] = said.strip().splitlines()[-1:]
    shutil.rmtree(work, ignore_errors=True)
    return result


def _busy(n: int, *, yielding: bool = False) -> list[subprocess.Popen[bytes]]:
    """`n` CPU-bound processes; `yielding`: at nice 19, so that they take only CPU time nobody else wants --
    still more than the standbys get (SCHED_IDLE ranks below nice 19), so they are starved all the same."""
    nice = ["import os; os.nice(19)"] if yielding else []
    # Lines, not `; `: `import os; os.nice(19); while True: pass` is a SyntaxError, and the quick mode's
    # "busy" trials ran on a quiet machine (the burner died at once, unseen).
    code = "\n".join([*nice, "while True: pass"])
    burners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    time.sleep(0.5)
    dead = [b.args for b in burners if b.poll() is not None]
    if dead:
        for b in burners:
            b.kill()
        raise RuntimeError(f"a CPU burner exited at once: {dead[0]}")
    return burners


def _summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ttrs = [t["ttr_s"] for t in trials if t["recovered"] and t["ttr_s"] is not None]

    def median_of(key: str) -> float | None:
        values = [t[key] for t in trials if t.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "trials": len(trials),
        "recovered": sum(1 for t in trials if t["recovered"]),
        "median_ttr_s": round(statistics.median(ttrs), 3) if ttrs else None,
        "worst_ttr_s": round(max(ttrs), 3) if ttrs else None,
        "ttr_s": [None if t["ttr_s"] is None else round(t["ttr_s"], 3) for t in trials],
        "paths": [t.get("path") for t in trials],
        "console_said_waiting": sum(1 for t in trials if t.get("waited_said")),
        "median_relaunch_s": median_of("relaunch_s"),
        "median_imports_s": median_of("imports_s"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5, help="runs per mode and condition")
    parser.add_argument("--conditions", default="busy,quiet", help="comma-separated: busy, quiet")
    parser.add_argument("--busy", type=int, default=2, help="extra CPU-bound processes in the busy condition")
    parser.add_argument("--train-s", type=float, default=12.0, help="training before the crash (s)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="a trial still running then failed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one trial per mode and condition, 3 s of training, one burner at nice 19",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if not conditions or any(c not in ("busy", "quiet") for c in conditions):
        print("standby_race.py: --conditions takes busy and/or quiet", file=sys.stderr)
        return 2
    if args.trials < 1 or args.busy < 0 or args.train_s <= 0:
        print("standby_race.py: --trials >= 1, --busy >= 0, --train-s > 0", file=sys.stderr)
        return 2
    trials, train_s = (1, 3.0) if args.quick else (args.trials, args.train_s)
    if args.quick:
        # CI's check that it runs (a quick run's figures are not quoted): one burner, half the CPU of two, at
        # nice 19 -- in the test suite it would otherwise take its share from the tests running beside it
        args.busy = min(args.busy, 1)
    fail_at = max(1, round(train_s / STEP_S))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in MODES} for c in conditions}
    started = time.monotonic()
    for trial in range(trials):
        for condition in conditions:
            order = MODES if trial % 2 == 0 else MODES[::-1]
            hogs = _busy(args.busy, yielding=args.quick) if condition == "busy" else []
            try:
                for mode in order:
                    result = _trial(mode, fail_at, args.timeout_s)
                    results[condition][mode].append(result)
                    ttr = "-" if result["ttr_s"] is None else f"{result['ttr_s']:.2f} s"
                    _say(f"trial {trial + 1}/{trials} {condition:5} {mode:7} TTR {ttr:>8}  path {result.get('path')}"
                         f"  ({result.get('why')})")  # fmt: skip
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    out: dict[str, Any] = {
        "benchmark": "standby_race",
        "quick": args.quick,
        "trials": trials,
        "train_s": train_s,
        "busy_processes": args.busy,
        "cpus": os.cpu_count(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    for condition in conditions:
        summary = {mode: _summary(results[condition][mode]) for mode in MODES}
        with_standby, off = summary["standby"]["median_ttr_s"], summary["off"]["median_ttr_s"]
        ratio = None if with_standby is None or not off else round(with_standby / off, 3)
        out[condition] = {
            **summary,
            "ratio": ratio,
            "standby_no_slower": None if ratio is None else ratio <= 1.0,
        }
    for condition in conditions:
        c = out[condition]
        _say(
            f"{condition}: median TTR with standbys {c['standby']['median_ttr_s']} s, off {c['off']['median_ttr_s']} s"
            f" (ratio {c['ratio']}); paths {c['standby']['paths']}"
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
